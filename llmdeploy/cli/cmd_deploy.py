"""`llmdeploy apply`: start a deployment's daemon (detached or in the foreground) and roll it to a spec.

Takes the deployment's lock (two CLI calls never interleave), starts the daemon when none answers on admin.sock,
sends it the spec and shows progress until the deployment is ready. `--dry-run` only diffs against state.db.
The commands that drive a running deployment are in `cmd_operate`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import typer

from llmdeploy.cli.cmd_spec import FILE_ARG, load_or_exit, render_plan
from llmdeploy.cli.console import EXIT_ERROR, console, examples, fail, plain, warn
from llmdeploy.cli.deploy_access import locked, tail_lines
from llmdeploy.cli.deploy_views import curl_line, phase_line, summary_table
from llmdeploy.control.client import AdminClient, AdminError
from llmdeploy.control.paths import DeploymentPaths
from llmdeploy.control.state import StateStore
from llmdeploy.openai_api import event_loop

READY_TIMEOUT_S = 1800.0


def apply(
    file: Path = FILE_ARG,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Show what apply would change (= plan with the diff); change nothing."
    ),
    foreground: bool = typer.Option(
        False,
        "--foreground",
        help="Run the daemon attached (systemd, containers); Ctrl-C/SIGTERM drains and stops.",
    ),
    force: bool = typer.Option(
        False, "--force", help="Apply even a spec whose revision was rolled back (rolls forward again)."
    ),
) -> None:
    """Start the deployment, or roll the running one to this spec.

    Validates first: an invalid file changes nothing (exit 2).

    Not running: starts the daemon (detached; state in $LLMDEPLOY_HOME/<name>/) and waits until it is ready.

    Running: "unchanged"; or a hot reload (auth, routing, sla, cloud, rollout, logging: no request dropped); or a new revision (model, engine, parallel) beside the stable one, taking rollout.canary_percent once ready.
    """
    from llmdeploy.control.controller import ApplyRequest
    from llmdeploy.control.keys import plan_keys, referenced_env
    from llmdeploy.control.revisions import spec_dict
    from llmdeploy.control.supervisor import unsupported

    spec = load_or_exit(file)
    paths = DeploymentPaths.of(spec.name)
    if dry_run:
        return _dry_run(spec, paths)
    if unsupported(spec):
        fail(unsupported(spec))
    try:
        paths.create()
    except RuntimeError as e:
        fail(str(e))
    with locked(paths):
        store = StateStore(paths.state_db)
        stored_keys = store.ensure_deployment(spec.name).key_hashes
        store.close()
        keys = plan_keys(spec, os.environ, stored_keys)
        req = ApplyRequest(
            spec=spec_dict(spec),
            force=force,
            env={n: os.environ.get(n) for n in referenced_env(spec)},
            key_hashes=keys.hashes,
        )
        if not foreground:
            return _apply_detached(paths, req, keys.new_keys, spec)
        if AdminClient(paths).alive():
            fail(f"deployment {spec.name!r} is already running (detached); `llmdeploy down` it first")
    _apply_foreground(paths, req, keys.new_keys)


def _apply_detached(paths: DeploymentPaths, req, new_keys: dict[str, str], spec) -> None:
    client = AdminClient(paths)
    started = _ensure_daemon(paths, client)
    try:
        result = client.apply(req.model_dump())
    except AdminError as e:
        if started:  # a daemon this apply started, with nothing to run (e.g. its port is taken), stops again
            _stop_if_empty(client)
        fail(e.message, EXIT_ERROR)
    _print_new_keys(new_keys)
    if result["result"] == "unchanged" and not started:
        plain(f"{spec.name}: unchanged")
        return
    plain(
        f"{spec.name}: {result['result']}"
        + (" (resumed from state.db)" if started and result["result"] == "unchanged" else "")
    )
    if share := result.get("canary"):
        plain(canary_share_line(share))
    if not started and result.get("revision") is None:  # hot reload / re-listen: nothing starts
        st = client.status()
    else:
        st = wait_ready(client, result.get("revision"))
    failed = next(
        (r for r in st["revisions"] if r["id"] == result.get("revision") and r["state"] == "failed"), None
    )
    if failed:
        tail = next(
            (e["data"].get("log_tail") for e in reversed(st["events"]) if e["kind"] == "engine-failed"), ""
        )
        fail(
            f"revision {failed['id']} failed to start: {failed['reason']}\n{tail or ''}\n(see `llmdeploy logs --revision {failed['id']}`)"
        )
    key_env = next((k.key_env for k in spec.auth.keys if k.key_env), None)
    console.print(summary_table(st))
    plain("try it:")
    plain(f"  {curl_line(st, key_env)}")  # plain: one line, copy-pastable


def _stop_if_empty(client: AdminClient) -> None:
    try:
        if not client.status().get("revisions"):
            client.down()
    except AdminError:
        pass  # it is gone already


def _ensure_daemon(paths: DeploymentPaths, client: AdminClient) -> bool:
    """Start the daemon unless one answers; True when this call started it."""
    from llmdeploy.control.daemon import EXIT_ALREADY_RUNNING, spawn_daemon

    if client.alive():
        return False
    proc = spawn_daemon(paths)
    deadline = time.monotonic() + 60
    with console.status("starting the daemon"):
        while time.monotonic() < deadline:
            if client.alive():
                return True
            if proc.poll() is not None:
                if proc.returncode == EXIT_ALREADY_RUNNING and client.alive():
                    return False
                fail(
                    f"the daemon exited with code {proc.returncode}; last lines of {paths.daemon_log}:\n{tail_lines(paths.daemon_log, 15)}"
                )
            time.sleep(0.1)
    fail(f"the daemon did not answer within 60s; see {paths.daemon_log}")


def wait_ready(client: AdminClient, revision: int | None) -> dict:
    """Show progress (weights loading, KV cache size, warm-up, router listening) until the live revisions
    are ready or the new one failed."""
    shown: dict[object, str] = {}
    deadline = time.monotonic() + READY_TIMEOUT_S

    def show(key: object, line: str) -> None:
        if shown.get(key) != line:
            shown[key] = line
            console.print(f"  {line}")

    try:
        with console.status("waiting for the deployment to become ready"):
            while True:
                st = client.status()
                live = {st["stable"], st["candidate"]} - {None}
                for rep in st["replicas"]:
                    show((rep["revision"], rep["replica"]), phase_line(rep))
                if st["listening"]:
                    show("router", f"router listening on {st['url']}")
                states = {r["id"]: r["state"] for r in st["revisions"]}
                if revision is not None and states.get(revision) not in ("starting", None):
                    if states[revision] == "failed" or all(
                        r["ready"] for r in st["replicas"] if r["revision"] in live
                    ):
                        return st
                elif (
                    revision is None
                    and st["listening"]
                    and all(r["ready"] for r in st["replicas"] if r["revision"] in live)
                ):
                    return st
                if time.monotonic() > deadline:
                    fail(
                        f"not ready after {READY_TIMEOUT_S:.0f}s; see `llmdeploy status` and `llmdeploy logs`"
                    )
                time.sleep(0.25)
    except KeyboardInterrupt:
        plain("interrupted; the deployment keeps starting in the background (`llmdeploy status`)", err=True)
        raise typer.Exit(130) from None
    except AdminError as e:
        fail(f"lost the daemon while waiting ({e.message}); see `llmdeploy logs`")


def _print_new_keys(new_keys: dict[str, str]) -> None:
    for name, key in new_keys.items():
        console.print(
            f"[bold yellow]Generated API key {name!r}[/] (shown only now; only its sha256 is stored):"
        )
        plain(f"  {key}")


def _apply_foreground(paths: DeploymentPaths, req, new_keys: dict[str, str]) -> None:
    from llmdeploy.control.daemon import run_daemon, setup_logging

    setup_logging(paths.daemon_log)
    _print_new_keys(new_keys)

    def applied(controller, result: dict) -> None:
        plain(
            f"{paths.name}: {result['result']}; running in the foreground (Ctrl-C or SIGTERM drains and stops)"
        )

    code = event_loop.run(run_daemon(paths, req, applied))
    raise typer.Exit(code)


def _dry_run(spec, paths: DeploymentPaths) -> None:
    from llmdeploy.cli.plan_live import last_applied_spec
    from llmdeploy.control.diff import diff_specs

    diff = diff_specs(last_applied_spec(paths), spec)
    est = None
    try:
        from llmdeploy.engine.estimate import estimate_spec

        est = estimate_spec(spec)
    except Exception as e:  # the estimate is a nicety here; the diff is the point
        warn(f"no memory estimate: {e}")
    console.print(render_plan(spec, est, diff.lines()))
    plain(f"apply would: {diff.summary()}")


APPLY_EXAMPLES = (
    "llmdeploy apply llmdeploy.yaml",
    "llmdeploy apply llmdeploy.yaml --dry-run",
    "llmdeploy apply llmdeploy.yaml --foreground   # systemd, containers",
)


def register(app: typer.Typer) -> None:
    app.command(epilog=examples(*APPLY_EXAMPLES))(apply)


def canary_share_line(share: dict) -> str:
    """What a changed rollout.canary_percent did to the running candidate."""
    rev, pct = share["candidate"], share["percent"]
    if pct >= 100:
        return f"rollout.canary_percent is 100: candidate revision {rev} promoted"
    if share["when"] == "ready":
        return f"rollout.canary_percent: candidate revision {rev} will take {pct:g}% once ready"
    return f"rollout.canary_percent: candidate revision {rev} now takes {pct:g}% of traffic"
