"""Proxy overhead of the llmdeploy router, against calling the upstream directly and against LiteLLM's proxy.

    python bench/router_overhead.py [--rate 200] [--seconds 10] [--concurrency 64]
                                    [--litellm-python /path/to/venv/bin/python] [--results bench/RESULTS.md]

One invocation starts a fast fake upstream (a bare ASGI app: canned chat completion, /load, /health), the router
in front of it (`python -m llmdeploy.router`, auth on), and, given a Python that has `litellm[proxy]`
(install it in its own venv, never in the project's), LiteLLM's proxy in front of the same upstream. For each
target it measures latency at a fixed arrival rate (open loop, --rate req/s for --seconds) and the maximum
req/s with --concurrency connections each sending small non-streaming requests back to back. The client is a
minimal keep-alive HTTP/1.1 client on raw asyncio streams, so it adds as little as possible of its own.
Prints a table (and appends it to --results FILE when given).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmdeploy.spec.addresses import free_port

ALIAS = "chat-model-v1"
KEY = "sk-bench-0123456789"
BODY = json.dumps(
    {"model": ALIAS, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}
).encode()
ANSWER = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "chat.completion",
        "created": 1,
        "model": ALIAS,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hi there!"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
    }
).encode()
LOAD = json.dumps(
    {
        "waiting": 0,
        "running": 0,
        "free_blocks": 100000,
        "total_blocks": 100000,
        "block_size": 16,
        "pending_prefill_tokens": 0,
        "prefill_tokens_per_s": 1e6,
        "decode_tokens_per_s": 1e5,
        "predicted_queue_wait_ms": 0.0,
        "kv_usage": 0.0,
        "max_model_len": 4096,
        "max_num_seqs": 100000,
        "ready": True,
    }
).encode()


# ---- the fast upstream (run in its own process) -------------------------------------------------------------
async def upstream_app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    more = True
    while more:  # drain the request body
        msg = await receive()
        more = msg.get("more_body", False)
    body = (
        LOAD if scope["path"] == "/load" else (b'{"status":"ok"}' if scope["path"] == "/health" else ANSWER)
    )
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def serve_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(upstream_app, host="127.0.0.1", port=port, log_level="error", access_log=False)


# ---- a minimal keep-alive HTTP/1.1 client -------------------------------------------------------------------
class Conn:
    def __init__(self, host: str, port: int, path: str, headers: dict[str, str]):
        self.host, self.port = host, port
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.request = (
            f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(BODY)}\r\n{extra}\r\n"
        ).encode() + BODY
        self.reader = self.writer = None

    async def send(self) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length, chunked = 0, False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if chunked:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def fixed_rate(
    port: int, path: str, headers: dict, rate: float, seconds: float
) -> tuple[list[float], int]:
    """Open loop: requests start every 1/rate s whatever happens; latency counts from the scheduled start."""
    idle: list[Conn] = []
    lat: list[float] = []
    errors = 0

    async def one(t_sched: float) -> None:
        nonlocal errors
        for reused in (bool(idle), False):  # a keep-alive connection the server timed out: once more, fresh
            conn = idle.pop() if reused else Conn("127.0.0.1", port, path, headers)
            try:
                status = await conn.send()
            except (OSError, asyncio.IncompleteReadError, ValueError):
                conn.close()
                if reused:
                    continue
                errors += 1
                return
            if status != 200:
                errors += 1
            lat.append(time.perf_counter() - t_sched)
            idle.append(conn)
            return

    tasks = []
    start = time.perf_counter()
    n = int(rate * seconds)
    for i in range(n):
        t = start + i / rate
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(t)))
    await asyncio.gather(*tasks)
    for c in idle:
        c.close()
    return lat, errors


async def max_throughput(
    port: int, path: str, headers: dict, concurrency: int, seconds: float
) -> tuple[float, int]:
    done = errors = 0
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, errors
        conn = Conn("127.0.0.1", port, path, headers)
        while time.perf_counter() < stop_at:
            try:
                if await conn.send() == 200:
                    done += 1
                else:
                    errors += 1
            except (OSError, asyncio.IncompleteReadError, ValueError):
                errors += 1
                conn.close()
                conn = Conn("127.0.0.1", port, path, headers)
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - t0), errors


# ---- processes --------------------------------------------------------------------------------------------
def start(cmd: list[str], health: str, env: dict | None = None, timeout_s: float = 120) -> subprocess.Popen:
    import urllib.request

    proc = subprocess.Popen(
        cmd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:3]} exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(health, timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    stop(proc)
    raise TimeoutError(f"{cmd[:3]} not healthy in {timeout_s}s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def router_path(extra: str | None) -> dict[str, str]:
    if not extra:
        return {}
    return {"PYTHONPATH": os.pathsep.join(p for p in (extra, os.environ.get("PYTHONPATH")) if p)}


def router_config(tmp: Path, port: int) -> Path:
    cfg = tmp / "llmdeploy.yaml"
    cfg.write_text(
        f"model: {{served_alias: {ALIAS}}}\nlisten: 127.0.0.1:{port}\nlogging: {{level: warning}}\n"
        "auth: {api_key_required: true, keys: [{name: bench, key_env: BENCH_KEY}]}\n"
        "routing: {burst: {local_rps: 1000000}, overflow: {max_queue_depth: 100000}}\n"
    )
    return cfg


def litellm_config(tmp: Path, upstream: int) -> Path:
    cfg = tmp / "litellm.yaml"
    cfg.write_text(
        f"model_list:\n  - model_name: {ALIAS}\n    litellm_params:\n      model: openai/{ALIAS}\n"
        f"      api_base: http://127.0.0.1:{upstream}/v1\n      api_key: dummy\n"
        f"general_settings:\n  master_key: {KEY}\nlitellm_settings:\n  telemetry: false\n  drop_params: true\n"
    )
    return cfg


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU of a process and its children so far (Linux /proc); 0 where unavailable."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(fields[i]) for i in (11, 12, 13, 14)) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


async def measure(port: int, path: str, headers: dict, args, pid: int | None) -> dict:
    await fixed_rate(port, path, headers, args.rate, 1.0)  # warm up connections and code paths
    lat, err = await fixed_rate(port, path, headers, args.rate, args.seconds)
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    rps, err2 = await max_throughput(port, path, headers, args.concurrency, args.seconds)
    done = rps * (time.perf_counter() - t0)
    cpu_ms = (cpu_seconds(pid) - cpu0) / done * 1000 if done and pid else float("nan")
    return {
        "p50": pct(lat, 0.5),
        "p99": pct(lat, 0.99),
        "mean": statistics.mean(lat) * 1000,
        "rps": rps,
        "cpu_ms": cpu_ms,
        "errors": err + err2,
        "n": len(lat),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=200)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument(
        "--litellm-python", default=None, help="a Python with litellm[proxy] installed (its own venv)"
    )
    ap.add_argument(
        "--router-path", default=None, help="extra PYTHONPATH for the router only (e.g. uvloop/httptools)"
    )
    ap.add_argument("--results", default=None, help="append the table to this file (e.g. bench/RESULTS.md)")
    ap.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream)
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="llmdeploy-bench-"))
    up, rp = free_port(), free_port()
    procs = []
    results: dict[str, dict] = {}
    try:
        procs.append(
            start([sys.executable, __file__, "--serve-upstream", str(up)], f"http://127.0.0.1:{up}/health")
        )
        procs.append(
            start(
                [
                    sys.executable,
                    "-m",
                    "llmdeploy.router",
                    "--config",
                    str(router_config(tmp, rp)),
                    "--engine",
                    f"http://127.0.0.1:{up}",
                ],
                f"http://127.0.0.1:{rp}/health",
                env={"BENCH_KEY": KEY, **router_path(args.router_path)},
            )
        )
        auth = {"authorization": f"Bearer {KEY}"}
        # the proxy's own process: its CPU per request is the overhead least disturbed by a busy machine
        targets = [("direct", up, {}, procs[0].pid), ("llmdeploy router", rp, auth, procs[1].pid)]
        if args.litellm_python:
            lp = free_port()
            litellm_bin = Path(args.litellm_python).with_name("litellm")
            cmd = [
                str(litellm_bin) if litellm_bin.exists() else shutil.which("litellm") or "litellm",
                "--config",
                str(litellm_config(tmp, up)),
                "--port",
                str(lp),
                "--num_workers",
                "1",
            ]
            procs.append(
                start(
                    cmd,
                    f"http://127.0.0.1:{lp}/health/liveliness",
                    env={"LITELLM_LOG": "ERROR"},
                    timeout_s=240,
                )
            )
            targets.append(("litellm proxy", lp, auth, procs[2].pid))
        for name, port, headers, pid in targets:
            results[name] = asyncio.run(measure(port, "/v1/chat/completions", headers, args, pid))
            print(f"{name:18s} {json.dumps({k: round(v, 2) for k, v in results[name].items()})}", flush=True)
    finally:
        for p in reversed(procs):
            stop(p)
        shutil.rmtree(tmp, ignore_errors=True)
    report = render(results, args)
    print(report)
    if args.results:
        with open(args.results, "a") as f:
            f.write(report + "\n")
    return 0


def render(r: dict[str, dict], args) -> str:
    d = r["direct"]
    lines = [
        f"## router_overhead.py, {time.strftime('%Y-%m-%d %H:%M')} UTC",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"client, upstream and proxies share it. Fixed rate {args.rate:g} req/s for {args.seconds:g} s; "
        f"max throughput with {args.concurrency} connections for {args.seconds:g} s; small non-streaming chat requests"
        + (f"; router with extra path {args.router_path} (uvloop/httptools)." if args.router_path else "."),
        "",
        "| target | p50 ms | p99 ms | added p50 ms | added p99 ms | max req/s | server CPU ms/req | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in r.items():
        added = (
            ("-", "-") if name == "direct" else (f"{m['p50'] - d['p50']:.2f}", f"{m['p99'] - d['p99']:.2f}")
        )
        lines.append(
            f"| {name} | {m['p50']:.2f} | {m['p99']:.2f} | {added[0]} | {added[1]} | {m['rps']:.0f} "
            f"| {m['cpu_ms']:.3f} | {m['errors']} |"
        )
    if "litellm proxy" in r:
        lines += [
            "",
            f"Max req/s, router / LiteLLM: {r['llmdeploy router']['rps'] / r['litellm proxy']['rps']:.1f}x",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
