"""Reaching a deployment from the CLI: which one (--name), its lock, its daemon's admin socket, its logs.

Shared by `cmd_deploy` (apply) and `cmd_operate` (canary, promote, rollback, status, history, logs, down).
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from llmdeploy.cli.console import EXIT_ERROR, fail, plain
from llmdeploy.control.client import AdminClient, AdminError, DaemonNotRunning
from llmdeploy.control.paths import DeploymentNotFound, DeploymentPaths, resolve_name

NAME_OPT = typer.Option(
    None, "--name", "-n", help="Deployment name (default: the only one in $LLMDEPLOY_HOME)."
)


def deployment_paths(name: str | None) -> DeploymentPaths:
    try:
        return DeploymentPaths.of(resolve_name(name))
    except DeploymentNotFound as e:
        fail(str(e))


def running_client(paths: DeploymentPaths) -> AdminClient:
    client = AdminClient(paths)
    if client.alive() is None:
        fail(f"deployment {paths.name!r} is not running; start it with `llmdeploy apply FILE`")
    return client


def locked(paths: DeploymentPaths):
    from llmdeploy.control.locking import deployment_lock

    return deployment_lock(
        paths.lock_file,
        on_wait=lambda: plain(f"waiting for another llmdeploy command on {paths.name!r}...", err=True),
    )


def admin_call(name: str | None, call) -> dict:
    paths = deployment_paths(name)
    with locked(paths):
        client = running_client(paths)
        try:
            return call(client)
        except DaemonNotRunning as e:
            fail(e.message)
        except AdminError as e:
            fail(e.message, 2 if e.status == 400 else EXIT_ERROR)


def tail_lines(path: Path, n: int) -> str:
    """The last n lines of a log file (reads at most its last 256 KiB); "" when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 256 * 1024))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
