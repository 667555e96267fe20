"""The per-deployment daemon: supervisor + embedded router + admin API in one asyncio process.

`python -m llmdeploy.control.daemon --name NAME` (what `apply` starts detached, logging to logs/daemon.log), or
run_daemon() in the CLI's own process for `apply --foreground`. SIGTERM/SIGINT and `down` drain: the router
stops accepting and finishes in-flight requests, then the engines get SIGTERM. A killed daemon leaves its
engines running; the next one re-adopts them from state.db.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from llmdeploy.control.admin import create_admin_app
from llmdeploy.control.controller import ApplyRequest, Controller
from llmdeploy.control.errors import ControlError
from llmdeploy.control.listener import open_admin_listener
from llmdeploy.control.paths import DeploymentPaths, home
from llmdeploy.control.state import StateStore
from llmdeploy.openai_api import event_loop

log = logging.getLogger("llmdeploy.daemon")
EXIT_ALREADY_RUNNING = 3
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def hold_daemon_lock(paths: DeploymentPaths) -> int | None:
    """One daemon per deployment: an flock held for the daemon's life (the kernel frees it on any exit)."""
    fd = os.open(paths.root / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


async def run_daemon(
    paths: DeploymentPaths,
    initial: ApplyRequest | None = None,
    on_applied: Callable[[Controller, dict], None] | None = None,
) -> int:
    lock_fd = hold_daemon_lock(paths)
    if lock_fd is None:
        log.error("a daemon for %r is already running", paths.name)
        return EXIT_ALREADY_RUNNING
    store = StateStore(paths.state_db)
    store.ensure_deployment(paths.name)
    store.update_deployment(daemon_pid=os.getpid(), running=1)
    controller = Controller(paths, store)
    stop = asyncio.Event()
    why: list[str] = []

    def request_stop(reason: str) -> None:
        if not why:
            why.append(reason)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, request_stop, signal.Signals(sig).name)
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    # held until recovery is done: an apply arriving on the fresh socket must see the recovered state
    await controller.lock.acquire()
    admin = await open_admin_listener(
        create_admin_app(controller, lambda: request_stop("down")), paths.admin_sock
    )
    log.info("daemon %s started (pid %s); admin API on %s", paths.name, os.getpid(), paths.admin_sock)
    code = 0
    try:
        try:
            await controller.recover()
        finally:
            controller.lock.release()
        if initial is not None:
            result = await controller.apply(initial)
            if on_applied:
                on_applied(controller, result)
        watcher = asyncio.create_task(controller.watch_candidate(), name="auto-rollback")
        autoscaler = asyncio.create_task(controller.autoscale(), name="autoscaler")
        await stop.wait()
        watcher.cancel()
        autoscaler.cancel()
    except ControlError as e:
        log.error("%s", e.message)
        code = 1
    finally:
        reason = why[0] if why else "error"
        controller.event("down", f"draining and stopping ({reason}); state kept")
        await controller.shutdown(stop_engines=True)
        store.update_deployment(running=0, daemon_pid=None)
        await admin.stop()
        with contextlib.suppress(FileNotFoundError):
            paths.admin_sock.unlink()
        store.close()
        os.close(lock_fd)
        log.info("daemon %s stopped", paths.name)
    return code


def setup_logging(log_file: Path | None = None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, handlers=handlers, force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)


def spawn_daemon(paths: DeploymentPaths) -> subprocess.Popen:
    """Start the daemon detached: its own session, stdio to logs/daemon.log, surviving the CLI."""
    with open(paths.daemon_log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "llmdeploy.control.daemon", "--name", paths.name],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=paths.root,
            env={**os.environ, "LLMDEPLOY_HOME": str(home()), "PYTHONUNBUFFERED": "1"},
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m llmdeploy.control.daemon", description="llmdeploy deployment daemon"
    )
    p.add_argument("--name", required=True, help="deployment name (state in $LLMDEPLOY_HOME/<name>/)")
    args = p.parse_args(argv)
    paths = DeploymentPaths.of(args.name).create()
    setup_logging()
    return event_loop.run(run_daemon(paths))


if __name__ == "__main__":
    sys.exit(main())
