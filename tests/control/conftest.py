"""End-to-end rig for the control plane: the real `llmdeploy` CLI as a subprocess, a temporary LLMDEPLOY_HOME,
real daemons and engines on ephemeral loopback ports, the tiny random Llama."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.helpers.procs import free_port

LLMDEPLOY = str(Path(sys.executable).with_name("llmdeploy"))
ALIAS = "tiny"


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def base_spec(name: str, model: Path, **over: Any) -> dict:
    spec = {
        "name": name,
        "model": {"path": str(model), "served_alias": ALIAS, "max_model_len": 256},
        "listen": f"127.0.0.1:{free_port()}",
        "engine": {"kv_cache_gb": 0.01, "max_num_seqs": 16},
        # the tests send bursts on purpose: keep them local and never queue-limited
        "routing": {
            "burst": {"local_rps": 100000},
            "overflow": {"use_predicted_ttft": False, "max_queue_depth": 4096},
        },
        "auth": {"api_key_required": False},
    }
    return deep_merge(spec, over)


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


class Cli:
    """Runs `llmdeploy ...` with LLMDEPLOY_HOME pointing at a test folder."""

    def __init__(self, home: Path, env: dict[str, str] | None = None):
        # the venv's bin first: scripts run by tests (the README walkthrough) call `llmdeploy` and `python`
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env = {**os.environ, "PATH": path, "LLMDEPLOY_HOME": str(home), **(env or {})}
        self.home = home

    def run(
        self, *args: str, timeout: float = 240, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [LLMDEPLOY, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**self.env, **(env or {})},
        )

    def ok(self, *args: str, **kw: Any) -> subprocess.CompletedProcess:
        r = self.run(*args, **kw)
        assert r.returncode == 0, f"llmdeploy {' '.join(args)} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r

    def status(self, name: str) -> dict:
        return json.loads(self.ok("status", "--name", name, "--json").stdout)

    def cleanup(self, name: str) -> None:
        """`down`, then make sure nothing this deployment started outlives the test session."""
        with contextlib.suppress(Exception):
            self.run("down", "--name", name, timeout=120)
        db = self.home / name / "state.db"
        if not db.exists():
            return
        import sqlite3

        with contextlib.closing(sqlite3.connect(db)) as c:
            pids = [r[0] for r in c.execute("SELECT pid FROM engines")]
            pids += [
                r[0] for r in c.execute("SELECT daemon_pid FROM deployment WHERE daemon_pid IS NOT NULL")
            ]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def split_of(st: dict) -> dict[int, float]:
    return {int(k): v for k, v in st["split"].items()}


def revision(st: dict, rev: int) -> dict:
    return next(r for r in st["revisions"] if r["id"] == rev)


def pids_of(st: dict, rev: int) -> list[int]:
    return [r["pid"] for r in st["replicas"] if r["revision"] == rev]


def port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(predicate, timeout_s: float = 60, interval_s: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


async def _send_many(
    url: str, sessions: list[str | None], headers: dict[str, str], concurrency: int, stream: bool
):
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, trust_env=False) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one(session: str | None) -> httpx.Response:
            h = dict(headers)
            if session is not None:
                h["x-session-id"] = session
            body = {"model": ALIAS, "prompt": "hi", "max_tokens": 1, "stream": stream}
            async with sem:
                r = await client.post("/v1/completions", json=body, headers=h)
                await r.aread()
                return r

        return await asyncio.gather(*(one(s) for s in sessions))


def send_many(
    url: str,
    sessions: list[str | None],
    headers: dict[str, str] | None = None,
    concurrency: int = 32,
    stream: bool = False,
) -> list[httpx.Response]:
    """Cheap requests (max_tokens 1), concurrently; the routing decision is in x-llmdeploy-revision."""
    return asyncio.run(_send_many(url, sessions, headers or {}, concurrency, stream))
