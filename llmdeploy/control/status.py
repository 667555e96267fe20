"""The status document (`llmdeploy status --json`): from the live daemon, or, when it is down, from state.db (the
last applied spec's settings, the split, the revisions) and from the engine processes that still run."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

import httpx
from pydantic import ValidationError

from llmdeploy.control import revisions as rv
from llmdeploy.control.bench_results import latest_curve
from llmdeploy.control.listener import router_url
from llmdeploy.control.paths import DeploymentPaths
from llmdeploy.control.processes import running_engines
from llmdeploy.control.state import EngineRecord, StateStore
from llmdeploy.spec.models import DeploymentSpec

if TYPE_CHECKING:
    from llmdeploy.control.supervisor import Supervisor
    from llmdeploy.control.traffic import Traffic
    from llmdeploy.policies.rollback import RollbackDecision

log = logging.getLogger("llmdeploy.control")
LOAD_KEYS = (
    "kv_usage",
    "waiting",
    "running",
    "free_blocks",
    "total_blocks",
    "max_num_seqs",
    "step_cost",
    "resources",
    "dtype",
    "quantization",
)
PROBE_TIMEOUT_S = 0.5  # status must answer at once, even when an orphaned engine hangs


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
        rows.append(
            {
                "id": r.id,
                "state": r.state,
                "role": role,
                "percent": shares.get(r.id, 0.0),
                "created": r.created,
                "spec_hash": r.spec_hash,
                "origin": r.origin,
                "reason": r.reason,
                "served": r.served,
                "phase": (phases or {}).get(r.id),
                "model": r.spec["model"]["path"],
            }
        )
    return rows


class LiveControl(Protocol):
    """What the live status reads from the daemon's controller, which passes itself in (the controller imports
    this module, so this module names only what it reads)."""

    @property
    def paths(self) -> DeploymentPaths: ...
    @property
    def store(self) -> StateStore: ...
    @property
    def supervisor(self) -> Supervisor: ...
    @property
    def router(self) -> Any: ...
    @property
    def listener(self) -> Any: ...
    @property
    def spec(self) -> DeploymentSpec | None: ...
    @property
    def traffic(self) -> Traffic: ...
    @property
    def judgement(self) -> RollbackDecision | None: ...
    @property
    def scaling(self) -> dict[str, Any] | None: ...


async def daemon_status(c: LiveControl) -> dict[str, Any]:
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
    d, t = c.judgement, c.traffic
    return {
        "name": c.paths.name,
        "daemon": {"pid": os.getpid(), "running": True, "time": time.time()},
        "url": router_url(spec) if spec else None,
        "listening": c.listener is not None,
        "served_alias": spec.model.served_alias if spec else None,
        "cloud": bool(spec and spec.cloud.enabled),
        "auth": bool(spec and spec.auth.api_key_required),
        "stable": t.stable,
        "candidate": t.candidate,
        "split": {str(k): v for k, v in t.split().items()},
        "revisions": revision_rows(c.store, t.stable, t.candidate, t.percent, phases),
        "replicas": replicas,
        "router": snapshot,
        "auto_rollback": None if d is None else {"rollback": d.rollback, "reason": d.reason, **d.numbers()},
        "autoscale": c.scaling,
        "events": [asdict(e) for e in c.store.events(12)],
        "last_auto_rollback": _last(c.store, "auto-rollback"),
        "bench": latest_curve(c.paths),
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
        spec = _last_spec(dep.spec if dep else None)
        return {
            "name": paths.name,
            "daemon": {"running": False, "note": note},
            "url": router_url(spec) if spec else None,
            "listening": False,
            "served_alias": spec.model.served_alias if spec else None,
            "cloud": bool(spec and spec.cloud.enabled),
            "auth": bool(spec and spec.auth.api_key_required),
            "settings_from": "last applied spec" if spec else None,
            "stable": stable,
            "candidate": candidate,
            "split": {str(k): v for k, v in rv.split(stable, candidate, percent).items()},
            "revisions": revision_rows(store, stable, candidate, percent),
            "replicas": [_orphan(rec) for rec in running_engines(store, paths)],
            "router": {},
            "auto_rollback": None,
            "autoscale": None,
            "events": [asdict(e) for e in store.events(12)],
            "last_auto_rollback": _last(store, "auto-rollback"),
            "bench": latest_curve(paths),
        }
    finally:
        store.close()


def _last_spec(raw: dict[str, Any] | None) -> DeploymentSpec | None:
    try:
        return DeploymentSpec.model_validate(raw) if raw else None
    except ValidationError:  # written by an older release whose schema differed: show what still parses
        return None


def _orphan(rec: EngineRecord) -> dict[str, Any]:
    """An engine still running while no daemon supervises it: what its /health and /load say now."""
    url = f"http://127.0.0.1:{rec.port}"
    healthy, load = _probe(f"{url}/health") is not None, _probe(f"{url}/load")
    return {
        "revision": rec.revision,
        "replica": rec.replica,
        "url": url,
        "pid": rec.pid,
        "ready": healthy,
        "phase": "running, unsupervised" if healthy else "not answering, unsupervised",
        "restarts": rec.restarts,
        "start_s": None,
        "kv_tokens": None,
        "failed": False,
        **{k: load.get(k) if isinstance(load, dict) else None for k in LOAD_KEYS},
    }


def _probe(url: str) -> Any:
    """The JSON a 200 answer carries, else None."""
    try:
        r = httpx.get(url, timeout=PROBE_TIMEOUT_S, trust_env=False)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
