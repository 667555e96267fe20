"""The status document (`llmdeploy status --json`): from the live daemon, or from state.db when it is down."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from llmdeploy.control import revisions as rv
from llmdeploy.control.listener import router_url
from llmdeploy.control.paths import DeploymentPaths
from llmdeploy.control.state import StateStore

if TYPE_CHECKING:
    from llmdeploy.control.controller import Controller

log = logging.getLogger("llmdeploy.control")
LOAD_KEYS = ("kv_usage", "waiting", "running", "free_blocks", "total_blocks")


def revision_rows(
    store: StateStore,
    stable: int | None,
    candidate: int | None,
    percent: float,
    phases: dict[int, str] | None = None,
) -> list[dict[str, Any]]:
    shares = rv.split(stable, candidate, percent)
    rows = []
    for r in store.revisions():
        role = "stable" if r.id == stable else "candidate" if r.id == candidate else None
        rows.append({
            "id": r.id, "state": r.state, "role": role, "percent": shares.get(r.id, 0.0), "created": r.created,
            "spec_hash": r.spec_hash, "origin": r.origin, "reason": r.reason, "served": r.served,
            "phase": (phases or {}).get(r.id), "model": r.spec["model"]["path"],
        })  # fmt: skip
    return rows


async def daemon_status(c: Controller) -> dict[str, Any]:
    spec = c.spec
    loads = await c.supervisor.loads()
    replicas = []
    for r in sorted(c.supervisor.all_replicas(), key=lambda r: (r.revision, r.name)):
        load = loads.get((r.revision, r.name)) or {}
        replicas.append({**r.to_json(), **{k: load.get(k) for k in LOAD_KEYS}})
    snapshot: dict[str, Any] = {}
    if c.router is not None:
        try:
            snapshot = c.router.snapshot()
        except Exception:  # status must answer even if the router's bookkeeping is off
            log.exception("router snapshot failed")
    phases = {rev: c.supervisor.revision_phase(rev) for rev in c.supervisor.replicas}
    d = c.rollout.judgement
    return {
        "name": c.paths.name,
        "daemon": {"pid": os.getpid(), "running": True, "time": time.time()},
        "url": router_url(spec) if spec else None,
        "listening": c.listener is not None,
        "served_alias": spec.model.served_alias if spec else None,
        "cloud": bool(spec and spec.cloud.enabled),
        "auth": bool(spec and spec.auth.api_key_required),
        "stable": c.stable,
        "candidate": c.candidate,
        "split": {str(k): v for k, v in rv.split(c.stable, c.candidate, c.percent).items()},
        "revisions": revision_rows(c.store, c.stable, c.candidate, c.percent, phases),
        "replicas": replicas,
        "router": snapshot,
        "auto_rollback": None if d is None else {"rollback": d.rollback, "reason": d.reason, **d.numbers()},
        "events": [asdict(e) for e in c.store.events(12)],
        "last_auto_rollback": _last(c.store, "auto-rollback"),
    }


def _last(store: StateStore, kind: str) -> dict[str, Any] | None:
    found = store.events(1, kind=kind)
    return asdict(found[0]) if found else None


def offline_status(paths: DeploymentPaths) -> dict[str, Any]:
    store = StateStore(paths.state_db)
    try:
        dep = store.deployment()
        stable, candidate, percent = (
            (dep.stable, dep.candidate, dep.candidate_percent) if dep else (None, None, 0.0)
        )
        died = "not running (it died; `llmdeploy apply FILE` recovers it)"
        note = "not running (stopped by `llmdeploy down`)" if dep and not dep.running else died
        return {
            "name": paths.name, "daemon": {"running": False, "note": note}, "url": None, "listening": False,
            "stable": stable, "candidate": candidate,
            "split": {str(k): v for k, v in rv.split(stable, candidate, percent).items()},
            "revisions": revision_rows(store, stable, candidate, percent),
            "replicas": [], "router": {}, "auto_rollback": None,
            "events": [asdict(e) for e in store.events(12)],
            "last_auto_rollback": _last(store, "auto-rollback"),
        }  # fmt: skip
    finally:
        store.close()
