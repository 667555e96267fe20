"""`llmdeploy canary | promote | rollback | history | status | logs | down`: drive a running deployment.

Mutating commands take the deployment's lock (two CLI calls never interleave) and talk to the daemon over
admin.sock; history and an offline status read state.db directly. Starting one is `cmd_deploy` (apply).
"""

from __future__ import annotations

import json
import time

import typer
from rich.text import Text

from llmdeploy.cli.cmd_deploy import wait_ready
from llmdeploy.cli.console import EXIT_INVALID, console, examples, fail, plain
from llmdeploy.cli.deploy_access import NAME_OPT, admin_call, deployment_paths, locked, tail_lines
from llmdeploy.cli.deploy_views import status_view
from llmdeploy.cli.observe_views import watch_frame
from llmdeploy.control.client import AdminClient, AdminError
from llmdeploy.control.state import StateStore

# ---- traffic ----------------------------------------------------------------------------------------------


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
    r = admin_call(name, lambda c: c.canary(percent))
    if r["result"] == "promoted":
        _say_promoted(r)
    else:
        plain(
            f"candidate revision {r['candidate']}: {r['percent']:g}%, stable revision {r['stable']}: {100 - r['percent']:g}%"
        )


def promote(name: str | None = NAME_OPT) -> None:
    """Make the ready candidate the stable revision (100%) and stop the old one."""
    _say_promoted(admin_call(name, lambda c: c.promote()))


def _say_promoted(r: dict) -> None:
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
    paths = deployment_paths(name)
    r = admin_call(paths.name, lambda c: c.rollback(to_revision))
    if r["result"] == "rolled back":
        plain(
            f"rolled back: candidate revision {r['rolled_back']} stopped; stable revision {r['stable']} takes 100%"
        )
        return
    plain(f"rolling back to revision {r['to_revision']} as new revision {r['revision']}")
    with AdminClient(paths) as client:
        st = wait_ready(client, r["revision"])
    state = next(x["state"] for x in st["revisions"] if x["id"] == r["revision"])
    if state == "failed":
        fail(f"revision {r['revision']} failed to start; revision {st['stable']} keeps serving")
    plain(f"revision {r['revision']} serves 100%")


# ---- read-only --------------------------------------------------------------------------------------------


def status(
    name: str | None = NAME_OPT,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    watch: bool = typer.Option(
        False, "--watch", "-w", help="Live view, refreshed every second (Ctrl-C leaves, exit 0)."
    ),
) -> None:
    """Revisions, traffic split, replicas with health, KV usage, queues, memory, request rates, cloud share and
    cost, the saved bench curve, last events.

    Shows why an automatic rollback happened, with its numbers. Works from state.db when the daemon is down.
    """
    if as_json and watch:
        fail("--json and --watch do not go together: --json is one document for scripts", EXIT_INVALID)
    paths = deployment_paths(name)
    if watch:
        _watch(paths)
        return
    st = _status_doc(paths)
    if as_json:
        plain(json.dumps(st, indent=2, default=str))
    else:
        console.print(status_view(st))


def _status_doc(paths) -> dict:
    try:
        with AdminClient(paths) as client:
            return client.status()
    except AdminError:
        from llmdeploy.control.status import offline_status

        return offline_status(paths)


def _watch(paths, period_s: float = 1.0) -> None:
    """rich Live over the same view as `status` (a terminal: redrawn in place on the alternate screen; a pipe:
    one frame after another). The daemon may come and go while it runs; Ctrl-C leaves with exit 0."""
    from rich.live import Live

    def frames():
        while True:
            started = time.monotonic()
            try:
                yield watch_frame(status_view(_status_doc(paths)))
            except Exception as e:  # a state.db being written, a daemon going down: show it, keep watching
                yield watch_frame(Text(""), f"status unavailable: {type(e).__name__}: {e}")
            time.sleep(max(0.0, period_s - (time.monotonic() - started)))

    try:
        if not console.is_terminal:
            for frame in frames():
                console.print(frame)
                console.rule(style="dim")
        with Live(console=console, auto_refresh=False, screen=True) as live:
            for frame in frames():
                live.update(frame, refresh=True)
    except KeyboardInterrupt:
        pass


def history(
    name: str | None = NAME_OPT,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Every revision: state, when, where it came from (apply, rollback to N) and what changed; then the
    autoscaler's changes, if any (--json: those are `scale` events in `status --json`)."""
    from llmdeploy.cli.deploy_views import history_table, revision_change, scaling_table

    paths = deployment_paths(name)
    store = StateStore(paths.state_db)
    revs, dep = store.revisions(), store.deployment()
    scaling = store.events(500, kind="scale")
    store.close()
    if as_json:
        changes = [
            revision_change(prev.spec if prev else None, r.spec)
            for prev, r in zip([None, *revs[:-1]], revs, strict=True)
        ]
        rows = [
            {
                "id": r.id,
                "state": r.state,
                "created": r.created,
                "origin": r.origin,
                "spec_hash": r.spec_hash,
                "change": change,
                "reason": r.reason,
            }
            for r, change in zip(revs, changes, strict=True)
        ]
        plain(json.dumps(rows, indent=2))
        return
    console.print(history_table(revs, dep.stable if dep else None, dep.candidate if dep else None))
    if scaling:
        console.print(scaling_table(scaling))


def logs(
    name: str | None = NAME_OPT,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines (Ctrl-C stops)."),
    lines: int = typer.Option(50, "--lines", help="How many of the last lines to show."),
    revision: int | None = typer.Option(
        None, "--revision", help="Show the engine logs of this revision instead of the daemon's."
    ),
) -> None:
    """The daemon's log (router, supervisor, events), or with --revision N the engine logs of that revision."""
    paths = deployment_paths(name)
    files = (
        sorted(paths.logs.glob(f"engine-rev{revision}-*.log")) if revision is not None else [paths.daemon_log]
    )
    files = [f for f in files if f.is_file()]
    if not files:
        fail(f"no logs yet in {paths.logs}")
    offsets = {}
    for f in files:
        prefix = f"[{f.stem}] " if len(files) > 1 else ""
        for line in tail_lines(f, lines).splitlines():
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

    paths = deployment_paths(name)
    with locked(paths):
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


def register(app: typer.Typer) -> None:
    cmd = lambda *ex: app.command(epilog=examples(*ex))  # noqa: E731
    cmd(
        "llmdeploy canary --percent 10",
        "llmdeploy canary --percent 0 --name chat",
        "llmdeploy canary --percent 100   # = promote",
    )(canary)
    cmd("llmdeploy promote", "llmdeploy promote --name chat")(promote)
    cmd("llmdeploy rollback", "llmdeploy rollback --to-revision 3", "llmdeploy history   # pick N")(rollback)
    cmd("llmdeploy history", "llmdeploy history --json")(history)
    cmd("llmdeploy status", "llmdeploy status --json | jq .split", "llmdeploy status --watch")(status)
    cmd("llmdeploy logs", "llmdeploy logs --follow", "llmdeploy logs --revision 2 --lines 100")(logs)
    cmd(
        "llmdeploy down",
        "llmdeploy down --name chat && llmdeploy apply llmdeploy.yaml   # same revision back",
    )(down)
