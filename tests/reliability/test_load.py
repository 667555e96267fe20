"""Load against a whole deployment (slow): a burst with the cloud on, kill -9 of the engine under load, and a long
mixed run with cancellations after which every KV block is back and the processes' memory is reported.

Sizes: the slow run is sized for about two minutes of the whole slow set on a 2-core machine; the full sizes
(1,000-request burst and mixed run) run with LLMDEPLOY_RELIABILITY_FULL=1, see tests/reliability/README.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.reliability.deployment import Deployment, chat, completion, full_or, rss_mb

pytestmark = pytest.mark.slow
STAY_LOCAL = {"x-llmdeploy-allow-cloud": "false"}


@dataclass
class Outcome:
    status: int
    backend: str = "?"
    events: list[Any] = field(default_factory=list)
    cancelled: bool = False
    error: str | None = None

    @property
    def stream_ok(self) -> bool:
        return (
            bool(self.events)
            and self.events[-1] == "[DONE]"
            and not any("error" in e for e in self.events[:-1])
        )


async def call(
    c: httpx.AsyncClient,
    path: str,
    body: Any,
    *,
    stream: bool = False,
    cancel_after: int | None = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
) -> Outcome:
    """One request. cancel_after: a stream is dropped after that many events; a non-stream one after 0.3 s."""
    kw: dict[str, Any] = {"content": raw} if raw is not None else {"json": body}
    try:
        if not stream:
            timeout = 0.3 if cancel_after is not None else 300
            r = await c.post(path, headers=headers, timeout=timeout, **kw)
            return Outcome(r.status_code, r.headers.get("x-llmdeploy-backend", "?"))
        async with c.stream("POST", path, headers=headers, timeout=300, **kw) as r:
            out = Outcome(r.status_code, r.headers.get("x-llmdeploy-backend", "?"))
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    out.events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
                    if cancel_after is not None and len(out.events) >= cancel_after:
                        out.cancelled = True
                        break
            return out
    except httpx.TimeoutException:
        return Outcome(0, cancelled=True)
    except httpx.HTTPError as exc:
        return Outcome(0, error=type(exc).__name__)


async def run_all(dep: Deployment, jobs: list[dict], concurrency: int) -> list[Outcome]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=dep.url, headers=dep.headers, limits=limits, trust_env=False) as c:
        sem = asyncio.Semaphore(concurrency)

        async def one(job: dict) -> Outcome:
            async with sem:
                return await call(c, **job)

        return await asyncio.gather(*(one(j) for j in jobs))


def job(i: int, rng: random.Random, stream: bool, **kw: Any) -> dict:
    max_tokens = rng.randint(1, 6)
    if i % 2:
        return {
            "path": "/v1/chat/completions",
            "body": chat(f"hello {i}", max_tokens=max_tokens, stream=stream),
            "stream": stream,
            **kw,
        }
    return {
        "path": "/v1/completions",
        "body": completion(f"count {i}", max_tokens=max_tokens, stream=stream),
        "stream": stream,
        **kw,
    }


def test_burst_with_the_cloud_on_fails_nothing(deployment):
    n, at_once = full_or(100, 1000), full_or(100, 250)
    rng = random.Random(1)
    jobs = [job(i, rng, stream=i % 3 == 0) for i in range(n)]
    started = time.monotonic()
    out = asyncio.run(run_all(deployment, jobs, concurrency=at_once))
    took = time.monotonic() - started
    failed = [o for o in out if o.status != 200 or (o.events and not o.stream_ok)]
    backends = {b: sum(o.backend == b for o in out) for b in ("local", "cloud")}
    deployment.marks["burst"] = {
        "requests": n,
        "at_once": at_once,
        "failed": len(failed),
        **backends,
        "seconds": round(took, 1),
    }
    print(f"burst: {deployment.marks['burst']}")
    assert not failed, [(o.status, o.error) for o in failed[:10]]
    assert backends["cloud"] > 0 and backends["local"] > 0


def test_kill_9_of_the_engine_under_load_fails_no_request(deployment):
    n = full_or(12, 48)
    rng = random.Random(2)
    jobs = [job(i, rng, stream=i % 2 == 0) for i in range(n)]
    for j in jobs:
        j["body"]["max_tokens"] = 48
        j["body"]["ignore_eos"] = True
    victim = deployment.engine()

    async def scenario() -> list[Outcome]:
        task = asyncio.ensure_future(run_all(deployment, jobs, concurrency=n))
        async with httpx.AsyncClient(trust_env=False) as c:
            deadline = time.monotonic() + 120
            # until every request is answered at the latest: a run where none decoded locally waited all 120 s
            while time.monotonic() < deadline and not task.done():
                load = (await c.get(f"{victim['url']}/load", timeout=5)).json()
                if load.get("decoding", load["running"]) >= 2:  # past their first token
                    break
                await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        os.kill(victim["pid"], signal.SIGKILL)
        return await task

    out = asyncio.run(scenario())
    failed = [o for o in out if o.status != 200 or (o.events and not o.stream_ok)]
    continued = sum(any(isinstance(e, dict) and "llmdeploy" in e for e in o.events) for o in out)
    deployment.marks["kill_9"] = {
        "requests": n,
        "failed": len(failed),
        "streams_continued_on_cloud": continued,
    }
    print(f"kill -9: {deployment.marks['kill_9']}")
    assert not failed, [(o.status, o.error, o.events[-2:]) for o in failed[:5]]
    again = deployment.wait_engine_ready(
        not_pid=victim["pid"]
    )  # the supervisor restarts it; later tests need it
    deployment.marks["kill_9"]["same_port_after_restart"] = again["url"] == victim["url"]
    assert again["pid"] != victim["pid"] and again["restarts"] == victim["restarts"] + 1


def mixed_jobs(n: int, rng: random.Random) -> list[dict]:
    bad = [
        {"raw": b'{"model": "tiny", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}"},
        {"body": completion("x", max_tokens=2, seed=2**64)},
        {"body": completion("x", max_tokens=2), "headers": {**STAY_LOCAL, "content-type": "text/plain"}},
        {"body": completion("x", max_tokens=2, model="no-such-model")},
    ]
    jobs = []
    for i in range(n):
        roll = rng.random()
        if roll < 0.4:
            j = job(i, rng, stream=False)
        elif roll < 0.7:
            j = job(i, rng, stream=True)
        elif roll < 0.85:
            j = job(i, rng, stream=True, cancel_after=1)
            j["body"].update(max_tokens=64, ignore_eos=True)
        elif roll < 0.9:
            j = job(i, rng, stream=False, cancel_after=0)
            j["body"].update(max_tokens=64, ignore_eos=True)
        else:
            j = {"path": "/v1/completions", "body": None, **bad[i % len(bad)], "expect": "4xx"}
        j.setdefault("headers", STAY_LOCAL)  # on the engine: its KV accounting is what is checked
        jobs.append(j)
    return jobs


def test_mixed_requests_with_cancellations_leak_no_kv_block(deployment):
    n = full_or(150, 1000)
    rng = random.Random(3)
    asyncio.run(
        run_all(deployment, [job(i, rng, stream=i % 2 == 0, headers=STAY_LOCAL) for i in range(16)], 8)
    )
    engine = deployment.engine()
    pids = {"engine": engine["pid"], "daemon": deployment.daemon_pid()}
    before = {k: rss_mb(p) for k, p in pids.items()}
    jobs = mixed_jobs(n, rng)
    expect = [j.pop("expect", "ok") for j in jobs]
    started = time.monotonic()
    out = asyncio.run(run_all(deployment, jobs, concurrency=8))
    took = time.monotonic() - started
    load = deployment.wait_engine_idle()
    after = {k: rss_mb(p) for k, p in pids.items()}
    leaked = load["total_blocks"] - load["free_blocks"]
    cancelled = sum(o.cancelled for o in out)
    server_errors = [o for o in out if o.status >= 500]
    wrong = [
        (e, o.status) for e, o in zip(expect, out, strict=True) if e == "4xx" and not 400 <= o.status < 500
    ]
    unfinished = [
        o for o, j in zip(out, jobs, strict=True) if j.get("stream") and not o.cancelled and not o.stream_ok
    ]
    deployment.marks["mixed"] = {
        "requests": n,
        "cancelled": cancelled,
        "invalid": expect.count("4xx"),
        "seconds": round(took, 1),
        "kv_blocks_leaked": leaked,
        "server_errors": len(server_errors),
        "rss_mb_before": {k: round(v, 1) for k, v in before.items()},
        "rss_mb_after": {k: round(v, 1) for k, v in after.items()},
        "rss_drift_mb": {k: round(after[k] - before[k], 1) for k in pids},
    }
    print(f"mixed: {deployment.marks['mixed']}")
    assert leaked == 0 and load["running"] == 0 and load["waiting"] == 0
    assert not server_errors and not wrong and not unfinished, (server_errors[:3], wrong[:3], unfinished[:3])
    assert cancelled > 0
