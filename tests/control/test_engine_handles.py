"""The local engine handle on real processes: the supervisor's pause between looks ends when the engine exits (its
pidfd), for a child of this process and for an adopted one alike, and the exit is read back as the engine's status."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from llmdeploy.control.launch import LocalProcess, StartFailed
from llmdeploy.engine.errors import CANNOT_LOAD_EXIT

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def timed_wait(handle, timeout_s: float, kill_pid: int | None = None, after_s: float = 0.3) -> float:
    """Seconds `handle.wait_exit(timeout_s)` took; `kill_pid` gets SIGKILL `after_s` into the wait."""

    async def run() -> float:
        loop = asyncio.get_running_loop()
        if kill_pid is not None:
            loop.call_later(after_s, os.kill, kill_pid, signal.SIGKILL)
        start = time.monotonic()
        await handle.wait_exit(timeout_s)
        return time.monotonic() - start

    return asyncio.run(run())


@pytest.mark.parametrize("adopted", [False, True], ids=["child", "adopted"])
def test_the_wait_ends_when_the_engine_is_killed(adopted):
    proc = subprocess.Popen(SLEEPER)
    try:
        handle = LocalProcess(0, proc.pid, None if adopted else proc)
        assert timed_wait(handle, 0.2) >= 0.2  # running: the whole pause
        took = timed_wait(handle, 30, kill_pid=proc.pid)
        assert took < 15, took  # the kill ended it, not the 30 s
        if not adopted:
            assert not asyncio.run(handle.alive()) and handle.exit_code() == -signal.SIGKILL
            assert handle.exit_description() == "killed by signal 9"
    finally:
        proc.kill()
        proc.wait()


def test_a_reaped_engine_ends_the_wait_at_once_and_reports_its_status():
    proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({CANNOT_LOAD_EXIT})"])
    proc.wait()
    handle = LocalProcess(0, proc.pid, proc)
    assert timed_wait(handle, 30) < 15
    assert handle.exit_code() == CANNOT_LOAD_EXIT and handle.exit_description() == "exited with code 78"


def test_a_failed_start_neither_waits_nor_has_a_status():
    handle = StartFailed("no placement")
    assert timed_wait(handle, 30) < 15
    assert handle.exit_code() is None and not asyncio.run(handle.alive())
