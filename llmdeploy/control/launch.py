"""How the supervisor starts, watches and stops one engine replica (ARCHITECTURE.md §10).

The supervisor owns the policy (health, restarts with backoff, drain, autoscaling, canary); a launcher owns the
mechanics of one backend: `LocalLauncher` runs the engine as a child process of the daemon on a loopback port,
`RayLauncher` (control/ray_launcher.py, imported only for `parallel.backend: ray`) runs it under a Ray actor on a
node of a Ray cluster. Each start returns an `EngineHandle`: where the engine listens, whether it still runs,
how it ended, and how to stop it. A replica gets a new handle per (re)start.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from llmdeploy.control.engine_args import engine_command
from llmdeploy.control.keys import referenced_env
from llmdeploy.control.processes import pid_alive, terminate
from llmdeploy.spec.models import DeploymentSpec

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class EngineJob:
    """One start of one replica's engine."""

    revision: int
    replica: str
    spec: DeploymentSpec
    env: dict[str, str] = field(repr=False)  # owner tag and internal token: environment only, never argv
    log_path: Path
    cwd: Path


class EngineHandle(Protocol):
    host: str
    port: int
    pid: int | None  # on the engine's own machine

    async def alive(self) -> bool: ...

    async def wait_exit(self, timeout_s: float) -> None:
        """Returns once the engine has exited or after timeout_s, whichever comes first."""

    def exit_description(self) -> str: ...

    def exit_code(self) -> int | None:
        """The engine's exit status once it has exited (negative: the signal), None while it runs or unknown."""

    async def stop(self, drain_s: float) -> None:
        """SIGTERM (the engine drains), SIGKILL after drain_s; returns once it has exited."""


class Launcher(Protocol):
    adopts: bool  # engines outlive the daemon and a new daemon re-adopts them (state.db records them)

    async def start(self, job: EngineJob, on_handle: HandleSink) -> EngineHandle:
        """Start the engine; `on_handle` gets the handle before any wait, so a cancelled start can be stopped."""

    def adopt(self, pid: int, port: int) -> EngineHandle:
        """An engine an earlier daemon started (only when `adopts`)."""

    async def release(self, revision: int, replica: str) -> None:
        """The replica is gone for good: free what was reserved for it across its restarts."""

    async def close(self) -> None: ...


class HandleSink(Protocol):
    def __call__(self, handle: EngineHandle) -> None: ...


def engine_env(spec: DeploymentSpec, extra: dict[str, str]) -> dict[str, str]:
    """The daemon's environment for a local engine, without the keys the router reads (engines need none)."""
    secrets = set(referenced_env(spec))
    return {**{k: v for k, v in os.environ.items() if k not in secrets}, **extra}


class LocalProcess:
    """An engine that is a child process of this daemon (proc), or one re-adopted from an earlier daemon (pid)."""

    host = LOOPBACK

    def __init__(self, port: int, pid: int, proc: subprocess.Popen | None = None):
        self.port, self.pid, self.proc = port, pid, proc

    async def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return pid_alive(self.pid)

    async def wait_exit(self, timeout_s: float) -> None:
        """At once on exit (the process's pidfd turns readable), so a crash is restarted without waiting out the
        supervisor's poll; a plain wait where pidfds are missing (Linux < 5.3, other systems)."""
        try:
            fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return  # gone already
        except (AttributeError, OSError):
            await asyncio.sleep(timeout_s)
            return
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
        try:
            await asyncio.wait_for(exited, timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            loop.remove_reader(fd)
            os.close(fd)

    def exit_description(self) -> str:
        if self.proc is None or self.proc.returncode is None:
            return "exited" if self.proc is None else "did not become ready in time"
        code = self.proc.returncode
        return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.returncode  # an adopted engine's is its old daemon's

    async def stop(self, drain_s: float) -> None:
        await asyncio.to_thread(terminate, self.pid, drain_s)


class LocalLauncher:
    """`python -m llmdeploy.engine` on a free loopback port, in its own session so that it outlives a killed
    daemon; its output is appended to the replica's log."""

    adopts = True

    async def start(self, job: EngineJob, on_handle: HandleSink) -> LocalProcess:
        from llmdeploy.spec.addresses import free_port

        port = free_port()
        with open(job.log_path, "ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting on port {port}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                engine_command(job.spec, port),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=engine_env(job.spec, job.env),
                start_new_session=True,
                cwd=job.cwd,
            )
        handle = LocalProcess(port, proc.pid, proc)
        on_handle(handle)
        return handle

    def adopt(self, pid: int, port: int) -> LocalProcess:
        return LocalProcess(port, pid)

    async def release(self, revision: int, replica: str) -> None:
        return None

    async def close(self) -> None:
        return None


class StartFailed:
    """A start that raised (e.g. Ray could not place the replica): reads as an engine that exited at once, so the
    supervisor's backoff, retries and giving up apply to it as to a crash."""

    host, port, pid = LOOPBACK, 0, None

    def __init__(self, why: str):
        self.why = why

    async def alive(self) -> bool:
        return False

    async def wait_exit(self, timeout_s: float) -> None:
        return None

    def exit_description(self) -> str:
        return f"could not start: {self.why}"

    def exit_code(self) -> int | None:
        return None

    async def stop(self, drain_s: float) -> None:
        return None
