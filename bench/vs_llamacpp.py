"""This engine against llama.cpp on the same GGUF, through each one's OpenAI-compatible server (issue 13, item 6).

    python bench/vs_llamacpp.py --llama-python /path/to/venv/bin/python [--clients 1,8] [--requests 8,32]
                                [--variants auto,int8,gguf,gguf-float] [--json out.json]

llama.cpp comes from llama-cpp-python, installed in its own venv (never the project's): `pip install
"llama-cpp-python[server]"` builds it from its sdist (about 6 minutes on 2 cores). Both servers get the embedded
SmolLM2-135M-Instruct GGUF (Q4_1): llama.cpp runs its Q4_1 weights as they are; this engine dequantizes them at
load to the dtype it serves (`auto`), re-quantizes them to int8 blocks (`int8`), or serves the file's own Q4_1 /
Q8_0 blocks as llama.cpp does (`gguf`, model.quantization: gguf; `gguf-float` keeps each layer's input in float32
where `gguf` rounds it to int8 as llama.cpp does). One server runs at a time (2 cores), each
driven by `llmdeploy bench` with workload W's shape (128-token prompts, 128 output tokens, EOS ignored), closed
loop at each --clients level. Prints one table (and the JSON of every level with --json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ceilings import cpu_info  # noqa: E402
from llmdeploy.spec.addresses import free_port  # noqa: E402
from llmdeploy.spec.sources import resolve_model_source  # noqa: E402

ALIAS = "smollm2"


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready ({url})")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server not ready after {timeout_s:.0f} s ({url})")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def server_cmd(name: str, gguf: Path, port: int, llama_python: str) -> tuple[list[str], str]:
    """The command line and the readiness URL of one server."""
    if name == "llama.cpp":
        cmd = [llama_python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", ALIAS]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--n_threads", str(os.cpu_count() or 2)]
        # its server interrupts a running request when the next one arrives unless told not to: 8 clients then got
        # 3 tokens each
        cmd += ["--n_ctx", "2048", "--interrupt_requests", "False"]
        return cmd, f"http://127.0.0.1:{port}/v1/models"
    cmd = [sys.executable, "-m", "llmdeploy.engine", "--model", str(gguf), "--served-alias", ALIAS]
    cmd += ["--port", str(port), "--max-model-len", "2048", "--log-level", "warning"]
    if name in ("int8", "gguf", "gguf-float"):
        cmd += ["--dtype", "float32", "--quantization", name.removesuffix("-float")]
    return cmd, f"http://127.0.0.1:{port}/health"


# gguf-float: the file's blocks with every layer input kept in float32 (LLMDEPLOY_QUANT_VNNI=0), beside gguf's
# llama.cpp-style int8 inputs where a kernel for them runs
VARIANT_ENV = {"gguf-float": {"LLMDEPLOY_QUANT_VNNI": "0"}}


def bench_level(port: int, clients: int, requests: int, out: Path) -> dict:
    cli = Path(sys.executable).with_name("llmdeploy")  # the console script of this venv
    cmd = [str(cli), "bench", "--url", f"http://127.0.0.1:{port}", "--model", ALIAS]
    cmd += ["--concurrency", str(clients), "--requests", str(requests), "--prompt-len", "128"]
    cmd += ["--output-len", "128", "--ignore-eos", "--warmup", "2", "--json", str(out)]
    subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1800)
    if not out.exists():
        return {}
    return json.loads(out.read_text())["levels"][0]


def run_server(name: str, gguf: Path, args, tmp: Path) -> list[dict]:
    port = free_port()
    cmd, ready = server_cmd(name, gguf, port, args.llama_python)
    with open(tmp / f"{name}.log", "w") as log:
        env = {**os.environ, **VARIANT_ENV.get(name, {})}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        rows = []
        try:
            wait_ready(ready, proc)
            for clients, requests in zip(args.clients, args.requests, strict=True):
                level = bench_level(port, clients, requests, tmp / f"{name}-{clients}.json")
                rows.append({**level, "server": name, "clients": clients})
                print(f"{name} at {clients} clients: {summary(level)}", file=sys.stderr)
        finally:
            stop(proc)
    return rows


def q(level: dict, key: str, p: str = "p50") -> float:
    return float((level.get(key) or {}).get(p) or 0.0)


def summary(level: dict) -> str:
    if not level:
        return "no result (see the server log)"
    return (
        f"{level['output_tokens_per_s']:.1f} output tok/s, TPOT p50 {q(level, 'tpot_ms'):.1f} ms, "
        f"TTFT p50 {q(level, 'ttft_ms'):.0f} ms, success {level.get('success_rate') or 0:.0%}"
    )


def table(rows: list[dict]) -> str:
    out = [
        "| server | clients | output tok/s | TPOT p50 ms | TTFT p50 ms | e2e p50 s | mean output tokens | success |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "output_tokens_per_s" not in r:
            out.append(f"| {r['server']} | {r['clients']} | no result | | | | | |")
            continue
        out.append(
            f"| {r['server']} | {r['clients']} | {r['output_tokens_per_s']:.1f} | {q(r, 'tpot_ms'):.1f} | "
            f"{q(r, 'ttft_ms'):.0f} | {q(r, 'e2e_ms') / 1000:.2f} | {r.get('mean_output_tokens') or 0:.0f} | "
            f"{r.get('success_rate') or 0:.0%} |"
        )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--llama-python", required=True, help="a Python with llama-cpp-python[server] (its own venv)"
    )
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--requests", default="8,32", help="requests per --clients level")
    ap.add_argument(
        "--variants",
        default="auto,int8,gguf",
        help="this engine's: auto (dtype auto), int8, gguf (the file's blocks), gguf-float (gguf, inputs never int8)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.clients = [int(x) for x in args.clients.split(",")]
    args.requests = [int(x) for x in args.requests.split(",")]
    gguf = Path(resolve_model_source("builtin:smollm2-135m-instruct").path)
    tmp = Path(tempfile.mkdtemp(prefix="llmdeploy-vs-llamacpp-"))
    print(cpu_info().line(), file=sys.stderr)
    rows = run_server("llama.cpp", gguf, args, tmp)
    for variant in args.variants.split(","):
        rows += run_server(variant, gguf, args, tmp)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cpu": cpu_info().line(), "gguf": str(gguf), "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
