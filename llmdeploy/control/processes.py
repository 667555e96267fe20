"""The engine processes a deployment starts, seen from outside: is this pid still our engine, what token was it
given, stop it. Used by the supervisor, by `down` when no daemon answers, and by `status` while the daemon is
down (it lists the engines that still run)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from llmdeploy.control.paths import DeploymentPaths
from llmdeploy.control.state import EngineRecord, StateStore
from llmdeploy.openai_api.headers import ENGINE_TOKEN_ENV

OWNER_ENV = "LLMDEPLOY_ENGINE_OWNER"


def owner_tag(paths: DeploymentPaths, revision: int, replica: str) -> str:
    return f"{paths.root}#{revision}/{replica}"


def is_our_engine(pid: int, port: int, owner: str) -> bool:
    """The pid still runs the engine we started there (not a recycled pid or someone else's server)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return (
        b"llmdeploy.engine" in argv
        and str(port).encode() in argv
        and f"{OWNER_ENV}={owner}".encode() in environ
    )


def engine_token(pid: int) -> str | None:
    """The internal token a running engine was started with (None: it needs none)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = f"{ENGINE_TOKEN_ENV}=".encode()
    found = next((e[len(prefix) :] for e in environ if e.startswith(prefix)), b"")
    return found.decode() or None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def terminate(pid: int, drain_s: float) -> None:
    """SIGTERM (the engine drains), then SIGKILL after drain_s. Blocking; engines lead their own group."""
    for sig, wait_s in ((signal.SIGTERM, drain_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _reap_or_alive(pid):
                return
            time.sleep(0.05)


def _reap_or_alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:
        pass
    return pid_alive(pid)


def stop_recorded_engines(store: StateStore, paths: DeploymentPaths, drain_s: float = 20.0) -> int:
    """Stop engines a dead daemon left behind (used by `down` when no daemon answers)."""
    stopped = 0
    for rec in store.engines():
        if is_our_engine(rec.pid, rec.port, owner_tag(paths, rec.revision, rec.replica)):
            terminate(rec.pid, drain_s)
            stopped += 1
        store.forget_engine(rec.revision, rec.replica)
    return stopped


def running_engines(store: StateStore, paths: DeploymentPaths) -> list[EngineRecord]:
    """The recorded engines that still run (ours: same pid, port and owner tag), e.g. after the daemon died."""
    return [
        rec
        for rec in store.engines()
        if pid_alive(rec.pid)
        and is_our_engine(rec.pid, rec.port, owner_tag(paths, rec.revision, rec.replica))
    ]
