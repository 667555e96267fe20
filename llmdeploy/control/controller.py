"""The control plane inside the daemon: applies specs, starts and recovers revisions, follows their readiness.

Moving traffic between revisions (canary, promote, rollback, the automatic rollback) lives in rollout.py; the
Controller owns that Rollout and stays the one object the admin API and the daemon talk to.

One asyncio lock serialises every operation (admin calls and the automatic rollback). The in-memory state
(applied spec, stable/candidate revision, split) is written to state.db after each change, so a new daemon
resumes exactly where a killed one stopped.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pydantic import BaseModel, Field

from llmdeploy.control import revisions as rv
from llmdeploy.control.diff import diff_specs
from llmdeploy.control.errors import ControlError
from llmdeploy.control.keys import mirror_env, referenced_env
from llmdeploy.control.listener import Listener, ListenError, open_router_listener, router_url
from llmdeploy.control.paths import DeploymentPaths
from llmdeploy.control.rollout import Rollout
from llmdeploy.control.state import StateStore
from llmdeploy.control.supervisor import Supervisor, is_our_engine, owner_tag, terminate, unsupported
from llmdeploy.policies.rollback import RollbackDecision
from llmdeploy.router.table import EngineEndpoint, RevisionRoute, RoutingTable
from llmdeploy.spec.models import DeploymentSpec

log = logging.getLogger("llmdeploy.control")
DRAIN_S = 30.0


class ApplyRequest(BaseModel):
    spec: dict[str, Any]
    force: bool = False
    env: dict[str, str | None] = Field(default_factory=dict)  # the caller's values of the referenced env vars
    key_hashes: dict[str, str] = Field(default_factory=dict)  # generated keys in effect: name -> sha256:<hex>


class Controller:
    def __init__(self, paths: DeploymentPaths, store: StateStore):
        self.paths, self.store = paths, store
        self.lock = asyncio.Lock()
        self.table = RoutingTable()
        self.supervisor = Supervisor(paths, store, self._engines_changed, self.event)
        self.spec: DeploymentSpec | None = None
        self.stable: int | None = None
        self.candidate: int | None = None
        self.percent = 0.0
        self.key_hashes: dict[str, str] = {}
        self.router: Any = None
        self.listener: Listener | None = None
        self._reconcile_task: asyncio.Task | None = None
        self.rollout = Rollout(self, DRAIN_S)

    # ---- bookkeeping (the Rollout uses these too) ----------------------------------------------------------

    def event(self, kind: str, message: str, revision: int | None = None, data: dict | None = None) -> None:
        self.store.add_event(kind, message, revision, data)
        log.info("[%s]%s %s", kind, f" rev {revision}" if revision else "", message)

    def save(self) -> None:
        self.store.update_deployment(
            spec=rv.spec_dict(self.spec) if self.spec else None, stable=self.stable, candidate=self.candidate,
            candidate_percent=self.percent, key_hashes=self.key_hashes,
        )  # fmt: skip

    def publish(self) -> None:
        """Swap the router's table: revisions, their share, and which engines are ready now."""
        shares = rv.split(self.stable, self.candidate, self.percent)
        routes = []
        for rev, role in ((self.stable, "stable"), (self.candidate, "candidate")):
            if rev is None:
                continue
            replicas = self.supervisor.replicas.get(rev, [])
            engines = [EngineEndpoint(r.url, r.name, r.ready) for r in replicas]
            # the name this revision's engines answer: a revision may rename the model
            alias = replicas[0].spec.model.served_alias if replicas else None
            routes.append(RevisionRoute(rev, role, shares[rev], engines, alias))
        self.table.swap(routes)

    def _engines_changed(self) -> None:
        self.publish()  # at once: an unready engine must leave the table before the next request
        if self._reconcile_task is None or self._reconcile_task.done():
            self._reconcile_task = asyncio.get_running_loop().create_task(self._reconcile())

    def state_of(self, rev: int) -> str:
        r = self.store.revision(rev)
        return r.state if r else "unknown"

    # ---- startup ------------------------------------------------------------------------------------------

    async def recover(self) -> None:
        """Resume from state.db: same revisions, same split; re-adopt live engines or start them again."""
        dep = self.store.deployment()
        if dep is None or dep.spec is None:
            return
        self.spec = DeploymentSpec.model_validate(dep.spec)
        _set_log_level(self.spec)
        self.stable, self.candidate, self.percent = dep.stable, dep.candidate, dep.candidate_percent
        self.key_hashes = dict(dep.key_hashes)
        keep = {r for r in (self.stable, self.candidate) if r is not None}
        records = self.store.engines()
        for rec in records:  # leftovers of a revision that was being stopped when the daemon died
            if rec.revision not in keep:
                if is_our_engine(rec.pid, rec.port, owner_tag(self.paths, rec.revision, rec.replica)):
                    await asyncio.to_thread(terminate, rec.pid, 5.0)
                self.store.forget_engine(rec.revision, rec.replica)
        for r in self.store.revisions():
            if r.state in rv.LIVE_STATES and r.id not in keep:
                self.store.set_revision_state(r.id, rv.RETIRED, "stopped while the daemon was down")
        for rev in sorted(keep):
            row = self.store.revision(rev)
            if row is None or row.state not in rv.LIVE_STATES:
                self.stable = None if rev == self.stable else self.stable
                self.candidate = None if rev == self.candidate else self.candidate
                continue
            self.supervisor.start_revision(
                rev, DeploymentSpec.model_validate(row.spec), [e for e in records if e.revision == rev]
            )
        if self.candidate is not None and self.stable is None:
            self.stable, self.candidate, self.percent = self.candidate, None, 0.0
        self.save()
        self.publish()
        try:
            await self._serve_router(self.spec)
        except ListenError as e:  # reported again by the apply that follows
            log.error("%s", e)
        self.event(
            "recover",
            f"resumed from state.db: stable {self.stable}, candidate {self.candidate} at {self.percent:g}%",
        )

    async def _serve_router(self, spec: DeploymentSpec) -> None:
        from llmdeploy.router.app import create_router  # the router is heavy; only the daemon needs it

        if self.router is None:
            self.router = create_router(spec, self.table, generated_key_hashes=self.key_hashes)
            await self.router.start()  # engine pool poller; the listener runs with lifespan off (re-listen)
        if self.listener is None:
            self.listener = await open_router_listener(self.router.app, spec, DRAIN_S)
            log.info("router listening on %s", router_url(spec))

    # ---- apply --------------------------------------------------------------------------------------------

    async def apply(self, req: ApplyRequest) -> dict[str, Any]:
        new = DeploymentSpec.model_validate(req.spec)
        async with self.lock:
            if refusal := unsupported(new):
                raise ControlError(refusal, 400)
            mirror_env(req.env, referenced_env(new))
            diff = diff_specs(self.spec, new)
            keys_changed = req.key_hashes != self.key_hashes
            needs_revision = diff.new_revision or self.stable is None
            if needs_revision and not diff.created and not req.force:
                self._refuse_rolled_back(new)
            if diff.unchanged and not keys_changed and not needs_revision:
                try:  # a recovered daemon may have found its port taken: say so rather than wait
                    await self._serve_router(new)
                except ListenError as e:
                    raise ControlError(str(e)) from None
                return self._apply_result("unchanged", diff)
            old, old_keys = self.spec, self.key_hashes
            self.spec, self.key_hashes = new, dict(req.key_hashes)
            try:
                if self.router is not None and (diff.hot_reload or keys_changed or diff.new_revision):
                    self._update_router(new)
                if diff.restart and old is not None:
                    await self._relisten(new)
                await self._serve_router(new)
                _set_log_level(new)
            except ListenError as e:
                self.spec, self.key_hashes = old, old_keys
                if self.router is not None and old is not None:
                    self._update_router(old)
                raise ControlError(str(e)) from None
            revision = self.start_revision(new, origin="apply") if needs_revision else None
            self.save()
            self.publish()
            self.event(
                "apply", f"{diff.summary()}" + (f": revision {revision} starting" if revision else ""), revision,
                {"changes": [c.path for c in diff.changes][:50]},
            )  # fmt: skip
            return self._apply_result(diff.summary(), diff, revision)

    def _apply_result(self, summary: str, diff: Any, revision: int | None = None) -> dict[str, Any]:
        return {"result": summary, "revision": revision, "diff": diff.to_json(), "stable": self.stable}

    def _refuse_rolled_back(self, new: DeploymentSpec) -> None:
        h = rv.revision_hash(new)
        stable = self.store.revision(self.stable) if self.stable else None
        if stable and stable.spec_hash == h:
            return
        for r in reversed(self.store.revisions()):
            if r.spec_hash == h and r.state == rv.ROLLED_BACK:
                raise ControlError(
                    f"this file declares the model/engine/parallel settings of revision {r.id}, which was rolled "
                    f"back ({r.reason or 'by hand'}); applying it would roll forward again. Fix the file, or pass "
                    "--force to start it as a new revision anyway."
                )

    def _update_router(self, spec: DeploymentSpec) -> None:
        self.router.update_spec(spec, generated_key_hashes=self.key_hashes)
        _set_log_level(spec)

    async def _relisten(self, spec: DeploymentSpec) -> None:
        """listen/tls changed: open the new listener first (when the port differs), then drain the old one."""
        old = self.listener
        same_port = old is not None and spec.listen_port == old.bound_port()
        if old is not None and same_port:
            await old.stop()
            self.listener = None
        self.listener = await open_router_listener(self.router.app, spec, DRAIN_S)
        if old is not None and not same_port:
            await old.stop()
        self.event("relisten", f"router now listening on {router_url(spec)}")

    def start_revision(self, spec: DeploymentSpec, origin: str) -> int:
        rev = self.store.create_revision(rv.spec_dict(spec), rv.revision_hash(spec), rv.STARTING, origin)
        if self.stable is None:
            self.stable, self.candidate, self.percent = rev, None, 0.0
        else:
            if self.candidate is not None:  # a newer candidate supersedes the one in flight
                old = self.candidate
                self.store.set_revision_state(old, rv.RETIRED, f"superseded by revision {rev}")
                asyncio.get_running_loop().create_task(self.supervisor.stop_revision(old, DRAIN_S))
                self.event("retire", f"candidate {old} superseded by revision {rev}", old)
            self.candidate, self.percent = rev, 0.0
        self.supervisor.start_revision(rev, spec)
        return rev

    # ---- readiness transitions ------------------------------------------------------------------------------

    async def _reconcile(self) -> None:
        async with self.lock:
            for rev in [r for r in (self.stable, self.candidate) if r is not None]:
                phase = self.supervisor.revision_phase(rev)
                state = self.state_of(rev)
                if phase == "failed" and state in rv.LIVE_STATES:
                    await self._revision_failed(rev)
                elif phase == "ready" and state == rv.STARTING:
                    self._revision_ready(rev)
            self.publish()

    def _revision_ready(self, rev: int) -> None:
        spec = self.spec
        assert spec is not None
        if rev == self.stable:
            self.store.set_revision_state(rev, rv.SERVING)
            self.store.mark_served(rev)
            self.event("ready", f"revision {rev} is ready and serving 100%", rev)
            return
        origin = self.store.revision(rev).origin  # type: ignore[union-attr]
        if origin.startswith("rollback") or spec.rollout.canary_percent >= 100:
            self.store.set_revision_state(rev, rv.READY)
            self.rollout.promote_candidate(
                reason="rollback" if origin.startswith("rollback") else "rollout.canary_percent is 100"
            )
            return
        self.percent = spec.rollout.canary_percent
        self.store.set_revision_state(rev, rv.SERVING if self.percent > 0 else rv.READY)
        self.save()
        self.event("ready", f"candidate revision {rev} is ready; it takes {self.percent:g}% of traffic", rev)

    async def _revision_failed(self, rev: int) -> None:
        reason = next((r.phase for r in self.supervisor.replicas.get(rev, []) if r.failed), "engines failed")
        self.store.set_revision_state(rev, rv.FAILED, reason)
        if rev == self.candidate:
            self.candidate, self.percent = None, 0.0
        elif rev == self.stable:
            self.stable = None
        self.save()
        self.publish()
        self.event("failed", f"revision {rev} failed to start: {reason}", rev)
        await self.supervisor.stop_revision(rev, 5.0)
        if self.candidate is not None and self.stable is None:
            self.stable, self.candidate = self.candidate, None
            self.save()

    # ---- traffic (rollout.py) ---------------------------------------------------------------------------------
    # the admin API and the daemon talk to the Controller alone; the Rollout works on its state under its lock

    async def canary(self, percent: float) -> dict[str, Any]:
        return await self.rollout.canary(percent)

    async def promote(self) -> dict[str, Any]:
        return await self.rollout.promote()

    async def rollback(
        self, to_revision: int | None = None, decision: RollbackDecision | None = None
    ) -> dict[str, Any]:
        return await self.rollout.rollback(to_revision, decision)

    async def watch_candidate(self, period_s: float = 1.0) -> None:
        await self.rollout.watch(period_s)

    # ---- status and shutdown ----------------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        from llmdeploy.control.status import daemon_status

        return await daemon_status(self)

    async def shutdown(self, stop_engines: bool) -> None:
        """Drain: the router stops accepting and finishes in-flight requests, then the engines get SIGTERM."""
        if self.listener is not None:
            await self.listener.stop()
            self.listener = None
        if self.router is not None and hasattr(self.router, "aclose"):
            await self.router.aclose()
        if stop_engines:
            await self.supervisor.close(DRAIN_S)
        else:
            await self.supervisor.detach()


def _set_log_level(spec: DeploymentSpec) -> None:
    logging.getLogger("llmdeploy").setLevel(spec.logging.level.upper())
