"""Real processes on 127.0.0.1 for tests: free ports, start a server, wait until it answers, stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from llmdeploy.spec.addresses import free_port  # noqa: F401 (the tests import it from here)


def ctrl_c_works() -> None:
    """Popen preexec_fn for a child that a test stops with SIGINT (Ctrl-C): a runner started in the background of
    a non-interactive shell ignores SIGINT, its children inherit that, and Python then installs no
    KeyboardInterrupt handler; the default disposition restores it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ServerProcess:
    """`with ServerProcess([...python args...], health_url) as p:`; logs go to log_path, shown on failure."""

    def __init__(
        self,
        args: list[str],
        health_url: str,
        log_path: Path,
        env: dict | None = None,
        timeout_s: float = 300,
    ):
        self.args, self.health_url, self.log_path, self.timeout_s = (
            args,
            health_url,
            Path(log_path),
            timeout_s,
        )
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        self.log = open(self.log_path, "wb")  # noqa: SIM115 -- lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, *self.args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.health_url, timeout=1, verify=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.timeout_s}s:\n{self.logs()}")

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15) -> int | None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if hasattr(self, "log"):
            self.log.close()
        return self.proc.returncode if self.proc else None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
