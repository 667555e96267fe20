"""`llmdeploy apply | canary | promote | rollback | history | status | logs | down`: drive a deployment's daemon.

Mutating commands take the deployment's lock (two CLI calls never interleave) and talk to the daemon over
admin.sock; history and an offline status read state.db directly.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import typer

from llmdeploy.cli.cmd_spec import FILE_ARG, load_or_exit, render_plan
from llmdeploy.cli.console import EXIT_ERROR, console, examples, fail, plain, warn
from llmdeploy.cli.deploy_views import curl_line, phase_line, status_view, summary_table
from llmdeploy.control.client import AdminClient, AdminError, DaemonNotRunning
from llmdeploy.control.paths import DeploymentNotFound, DeploymentPaths, resolve_name
from llmdeploy.control.state import StateStore

NAME_OPT = typer.Option(
    None, "--name", "-n", help="Deployment name (default: the only one in $LLMDEPLOY_HOME)."
)
READY_TIMEOUT_S = 1800.0


def _paths(name: str | None) -> DeploymentPaths:
    try:
        return DeploymentPaths.of(resolve_name(name))
    except DeploymentNotFound as e:
        fail(str(e))


def _running_client(paths: DeploymentPaths) -> AdminClient:
    client = AdminClient(paths)
    if client.alive() is None:
        fail(f"deployment {paths.name!r} is not running; start it with `llmdeploy apply FILE`")
    return client


def _locked(paths: DeploymentPaths):
    from llmdeploy.control.locking import deployment_lock

    return deployment_lock(
        paths.lock_file,
        on_wait=lambda: plain(f"waiting for another llmdeploy command on {paths.name!r}...", err=True),
    )


# ---- apply ------------------------------------------------------------------------------------------------


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
    with _locked(paths):
        store = StateStore(paths.state_db)
        stored_keys = store.ensure_deployment(spec.name).key_hashes
        store.close()
        keys = plan_keys(spec, os.environ, stored_keys)
        req = ApplyRequest(
            spec=spec_dict(spec), force=force, env={n: os.environ.get(n) for n in referenced_env(spec)},
            key_hashes=keys.hashes,
        )  # fmt: skip
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
        fail(e.message, EXIT_ERROR)
    _print_new_keys(new_keys)
    if result["result"] == "unchanged" and not started:
        plain(f"{spec.name}: unchanged")
        return
    plain(
        f"{spec.name}: {result['result']}"
        + (" (resumed from state.db)" if started and result["result"] == "unchanged" else "")
    )
    if not started and result.get("revision") is None:  # hot reload / re-listen: nothing starts
        st = client.status()
    else:
        st = _wait_ready(client, result.get("revision"))
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
                    f"the daemon exited with code {proc.returncode}; last lines of {paths.daemon_log}:\n{_tail(paths.daemon_log, 15)}"
                )
            time.sleep(0.1)
    fail(f"the daemon did not answer within 60s; see {paths.daemon_log}")


def _wait_ready(client: AdminClient, revision: int | None) -> dict:
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

    code = asyncio.run(run_daemon(paths, req, applied))
    raise typer.Exit(code)


def _dry_run(spec, paths: DeploymentPaths) -> None:
    from llmdeploy.control.diff import diff_specs

    last = None
    if paths.state_db.is_file():
        store = StateStore(paths.state_db)
        dep = store.deployment()
        last = dep.spec if dep else None
        store.close()
    diff = diff_specs(last, spec)
    est = None
    try:
        from llmdeploy.engine.estimate import estimate_spec

        est = estimate_spec(spec)
    except Exception as e:  # the estimate is a nicety here; the diff is the point
        warn(f"no memory estimate: {e}")
    console.print(render_plan(spec, est, diff.lines()))
    plain(f"apply would: {diff.summary()}")


# ---- traffic ----------------------------------------------------------------------------------------------


def _admin_call(name: str | None, call) -> dict:
    paths = _paths(name)
    with _locked(paths):
        client = _running_client(paths)
        try:
            return call(client)
        except DaemonNotRunning as e:
            fail(e.message)
        except AdminError as e:
            fail(e.message, 2 if e.status == 400 else EXIT_ERROR)


def canary(
    percent: float = typer.Option(
        ...,
        "--percent",
        "-p",
        min=0,
        max=100,
        help="Share of traffic for the candidate revision, 0-100; 100 promotes.",
    ),
    name: str | None = NAME_OPT,
) -> None:
    """Give the candidate revision N% of traffic (sticky per session); refused unless a candidate is ready."""
    r = _admin_call(name, lambda c: c.canary(percent))
    if r["result"] == "promoted":
        plain(f"revision {r['stable']} promoted to 100%; revision {r['retired']} stopped")
    else:
        plain(
            f"candidate revision {r['candidate']}: {r['percent']:g}%, stable revision {r['stable']}: {100 - r['percent']:g}%"
        )


def promote(name: str | None = NAME_OPT) -> None:
    """Make the ready candidate the stable revision (100%) and stop the old one."""
    r = _admin_call(name, lambda c: c.promote())
    plain(f"revision {r['stable']} promoted to 100%; revision {r['retired']} stopped")


def rollback(
    to_revision: int | None = typer.Option(
        None, "--to-revision", help="Re-deploy this earlier revision (see `llmdeploy history`)."
    ),
    name: str | None = NAME_OPT,
) -> None:
    """Abort the canary, or re-deploy the previous revision (like `kubectl rollout undo`).

    During a canary: 100% of traffic back to the stable revision; the candidate's engines stop.

    With no canary: the previous revision's spec (or --to-revision N's) starts as a new revision id and takes 100% once ready.

    A later `apply` of the rolled-back file warns that it would roll forward again and needs --force.
    """
    paths = _paths(name)
    r = _admin_call(paths.name, lambda c: c.rollback(to_revision))
    if r["result"] == "rolled back":
        plain(
            f"rolled back: candidate revision {r['rolled_back']} stopped; stable revision {r['stable']} takes 100%"
        )
        return
    plain(f"rolling back to revision {r['to_revision']} as new revision {r['revision']}")
    with AdminClient(paths) as client:
        st = _wait_ready(client, r["revision"])
    state = next(x["state"] for x in st["revisions"] if x["id"] == r["revision"])
    if state == "failed":
        fail(f"revision {r['revision']} failed to start; revision {st['stable']} keeps serving")
    plain(f"revision {r['revision']} serves 100%")


# ---- read-only --------------------------------------------------------------------------------------------


def status(
    name: str | None = NAME_OPT,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Revisions, traffic split, replicas with health, KV usage, queues, request rates, cloud share, last events.

    Shows why an automatic rollback happened, with its numbers. Works from state.db when the daemon is down.
    """
    paths = _paths(name)
    try:
        with AdminClient(paths) as client:
            st = client.status()
    except AdminError:
        from llmdeploy.control.status import offline_status

        st = offline_status(paths)
    if as_json:
        plain(json.dumps(st, indent=2, default=str))
    else:
        console.print(status_view(st))


def history(
    name: str | None = NAME_OPT,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Every revision: state, when, where it came from (apply, rollback to N) and what changed."""
    from llmdeploy.cli.deploy_views import history_table, revision_change

    paths = _paths(name)
    store = StateStore(paths.state_db)
    revs, dep = store.revisions(), store.deployment()
    store.close()
    if as_json:
        changes = [
            revision_change(prev.spec if prev else None, r.spec)
            for prev, r in zip([None, *revs[:-1]], revs, strict=True)
        ]
        rows = [
            {"id": r.id, "state": r.state, "created": r.created, "origin": r.origin, "spec_hash": r.spec_hash,
             "change": change, "reason": r.reason}
            for r, change in zip(revs, changes, strict=True)
        ]  # fmt: skip
        plain(json.dumps(rows, indent=2))
        return
    console.print(history_table(revs, dep.stable if dep else None, dep.candidate if dep else None))


def logs(
    name: str | None = NAME_OPT,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines (Ctrl-C stops)."),
    lines: int = typer.Option(50, "--lines", help="How many of the last lines to show."),
    revision: int | None = typer.Option(
        None, "--revision", help="Show the engine logs of this revision instead of the daemon's."
    ),
) -> None:
    """The daemon's log (router, supervisor, events), or with --revision N the engine logs of that revision."""
    paths = _paths(name)
    files = (
        sorted(paths.logs.glob(f"engine-rev{revision}-*.log")) if revision is not None else [paths.daemon_log]
    )
    files = [f for f in files if f.is_file()]
    if not files:
        fail(f"no logs yet in {paths.logs}")
    offsets = {}
    for f in files:
        prefix = f"[{f.stem}] " if len(files) > 1 else ""
        for line in _tail(f, lines).splitlines():
            plain(prefix + line)
        offsets[f] = f.stat().st_size
    try:
        while follow:
            time.sleep(0.5)
            for f in files:
                with open(f, "rb") as fh:
                    fh.seek(offsets[f])
                    chunk = fh.read()
                    offsets[f] = fh.tell()
                prefix = f"[{f.stem}] " if len(files) > 1 else ""
                for line in chunk.decode(errors="replace").splitlines():
                    plain(prefix + line)
    except KeyboardInterrupt:
        pass


def down(name: str | None = NAME_OPT) -> None:
    """Drain and stop the router and the engines; keep the state (`apply` brings back the same revision).

    In-flight requests finish first (bounded). With a daemon that died, stops the engines it left behind.
    """
    from llmdeploy.control.supervisor import pid_alive, stop_recorded_engines

    paths = _paths(name)
    with _locked(paths):
        client = AdminClient(paths)
        info = client.alive()
        if info:
            with console.status("draining"):
                client.down()
                deadline = time.monotonic() + 120
                while pid_alive(info["pid"]) and time.monotonic() < deadline:
                    time.sleep(0.1)
            if pid_alive(info["pid"]):
                fail(f"the daemon (pid {info['pid']}) is still running after 120s; see `llmdeploy logs`")
        else:  # no daemon: stop engines a killed daemon left behind
            store = StateStore(paths.state_db)
            n = stop_recorded_engines(store, paths)
            store.update_deployment(running=0, daemon_pid=None)
            store.close()
            if n:
                plain(f"stopped {n} engine(s) left by a daemon that had died")
    plain(f"{paths.name}: stopped; state kept in {paths.root} (`llmdeploy apply FILE` brings it back)")


def _tail(path: Path, n: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 256 * 1024))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def register(app: typer.Typer) -> None:
    cmd = lambda *ex: app.command(epilog=examples(*ex))  # noqa: E731
    cmd("llmdeploy apply llmdeploy.yaml", "llmdeploy apply llmdeploy.yaml --dry-run",
        "llmdeploy apply llmdeploy.yaml --foreground   # systemd, containers")(apply)  # fmt: skip
    cmd(
        "llmdeploy canary --percent 10",
        "llmdeploy canary --percent 0 --name chat",
        "llmdeploy canary --percent 100   # = promote",
    )(canary)
    cmd("llmdeploy promote", "llmdeploy promote --name chat")(promote)
    cmd("llmdeploy rollback", "llmdeploy rollback --to-revision 3", "llmdeploy history   # pick N")(rollback)
    cmd("llmdeploy history", "llmdeploy history --json")(history)
    cmd("llmdeploy status", "llmdeploy status --json | jq .split", "watch -n1 llmdeploy status")(status)
    cmd("llmdeploy logs", "llmdeploy logs --follow", "llmdeploy logs --revision 2 --lines 100")(logs)
    cmd(
        "llmdeploy down",
        "llmdeploy down --name chat && llmdeploy apply llmdeploy.yaml   # same revision back",
    )(down)
