"""The control plane inside the daemon: applies specs, starts and recovers revisions, follows their readiness.

Every change of the traffic between revisions (canary, promote, rollback, the automatic rollback, a revision
that became ready or failed) is decided by a pure function of transitions.py over the value of traffic.py;
the Controller is the one writer: it carries out the move that function returns (ARCHITECTURE.md §6, §7).
The auto-rollback watcher (rollout.py) judges the candidate and asks the Controller for that move; the
autoscaler (autoscaler.py) judges the stable revision's replicas and asks for transitions.scale the same way.

One asyncio lock serialises every operation (admin calls, the automatic rollback, the autoscaler's moves). The
in-memory state (applied spec, traffic) is written to state.db after each change, so a new daemon resumes
exactly where a killed one stopped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from pydantic import BaseModel, Field

from llmdeploy.control import revisions as rv
from llmdeploy.control import traffic as tr
from llmdeploy.control import transitions as tx
from llmdeploy.control.autoscaler import Autoscaler, observe
from llmdeploy.control.diff import diff_specs
from llmdeploy.control.errors import ControlError
from llmdeploy.control.keys import mirror_env, referenced_env
from llmdeploy.control.listener import Listener, ListenError, open_router_listener, router_url
from llmdeploy.control.paths import DeploymentPaths
from llmdeploy.control.rollout import AutoRollbackWatcher, WatchedCandidate
from llmdeploy.control.state import StateStore
from llmdeploy.control.status import daemon_status
from llmdeploy.control.supervisor import Supervisor, is_our_engine, owner_tag, terminate, unsupported
from llmdeploy.policies.autoscale import Decision
from llmdeploy.policies.rollback import RollbackDecision
from llmdeploy.router.table import EngineEndpoint, RevisionRoute, RoutingTable
from llmdeploy.spec.models import DeploymentSpec

log = logging.getLogger("llmdeploy.control")
DRAIN_S = 30.0  # how long a revision that leaves the table may finish its in-flight requests
FAILED_STOP_S = 5.0  # a revision that failed has nothing in flight worth waiting for


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
        self.traffic = tr.Traffic()  # written only by _carry_out (and recover, before anything runs)
        self.key_hashes: dict[str, str] = {}
        self.router: Any = None
        self.listener: Listener | None = None
        self.watcher = AutoRollbackWatcher(self._watched_candidate, self.auto_rollback)
        self.autoscaler = Autoscaler(lambda now: observe(self, now), self.scale)
        self._reconcile_task: asyncio.Task | None = None
        self._stopping: set[asyncio.Task] = set()  # background stops: held so they are not collected mid-way

    # ---- the one writer of the traffic ---------------------------------------------------------------------

    def snapshot(self) -> tr.Snapshot:
        engines = {
            rev: tr.Engines(
                self.supervisor.revision_phase(rev),  # type: ignore[arg-type]
                tuple(tr.ReplicaPhase(r.name, r.phase, r.failed) for r in reps),
            )
            for rev, reps in self.supervisor.replicas.items()
        }
        return tr.Snapshot(self.traffic, self.spec, tuple(self.store.revisions()), engines)

    async def _carry_out(self, move: tr.Move | tr.Refusal) -> dict[str, Any]:
        """Carry out a transition's move, effect by effect; a refusal changes nothing. Under the lock."""
        if isinstance(move, tr.Refusal):
            raise ControlError(move.message, move.status)
        for step in move.steps():
            self.traffic = step.traffic
            for effect in step.effects:
                await self._effect(effect)
        return move.answer

    async def _effect(self, effect: tr.Effect) -> None:
        match effect:
            case tr.StartRevision(revision=planned, spec=spec, origin=origin):
                data, spec_hash = rv.spec_dict(spec), rv.revision_hash(spec)
                created = self.store.create_revision(data, spec_hash, rv.STARTING, origin)
                if created != planned:  # someone else wrote the revisions table: the move's ids are wrong
                    raise RuntimeError(f"state.db gave revision {created}; the move planned {planned}")
                self.supervisor.start_revision(created, spec)
            case tr.StopRevision(revision=rev, wait=wait, failed=failed):
                stopping = self.supervisor.stop_revision(rev, FAILED_STOP_S if failed else DRAIN_S)
                if wait:
                    await stopping
                else:
                    self._in_background(stopping)
            case tr.AddReplica(revision=rev):
                self.supervisor.add_replica(rev)
            case tr.RemoveReplica(revision=rev, replica=name):
                if (removed := self.supervisor.remove_replica(rev, name)) is not None:
                    self._in_background(self.supervisor.drain(removed, DRAIN_S))
            case tr.SetRevisionState(revision=rev, state=state, reason=reason):
                self.store.set_revision_state(rev, state, reason)
            case tr.MarkServed(revision=rev):
                self.store.mark_served(rev)
            case tr.UseSpec(spec=spec):
                self.spec = spec
            case tr.Persist():
                self.save()
            case tr.Publish():
                self.publish()
            case tr.Emit(kind=kind, message=message, revision=rev, data=data):
                self.event(kind, message, rev, data)

    def _in_background(self, stopping: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(stopping)
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    # ---- bookkeeping ---------------------------------------------------------------------------------------

    def event(self, kind: str, message: str, revision: int | None = None, data: dict | None = None) -> None:
        self.store.add_event(kind, message, revision, data)
        if self.router is not None:  # the router's rollback/restart counters (/metrics)
            self.router.control_event(kind, revision)
        log.info("[%s]%s %s", kind, f" rev {revision}" if revision else "", message)

    def save(self) -> None:
        t = self.traffic
        self.store.update_deployment(  # one write: a new daemon never reads a spec with another's traffic
            spec=rv.spec_dict(self.spec) if self.spec else None,
            stable=t.stable,
            candidate=t.candidate,
            candidate_percent=t.percent,
            key_hashes=self.key_hashes,
        )

    def publish(self) -> None:
        """Swap the router's table: revisions, their share, and which engines are ready now."""
        shares = self.traffic.split()
        routes = []
        for rev, role in self.traffic.roles():
            replicas = self.supervisor.replicas.get(rev, [])
            engines = [EngineEndpoint(r.url, r.name, r.ready, r.token) for r in replicas]
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

    @property
    def judgement(self) -> RollbackDecision | None:
        """The watcher's last judgement of the candidate (status shows it)."""
        return self.watcher.judgement

    # ---- startup -------------------------------------------------------------------------------------------

    async def recover(self) -> None:
        """Resume from state.db: same revisions, same split; re-adopt live engines or start them again."""
        dep = self.store.deployment()
        if dep is None or dep.spec is None:
            return
        self.spec = DeploymentSpec.model_validate(dep.spec)
        _set_log_level(self.spec)
        stored = tr.Traffic(dep.stable, dep.candidate, dep.candidate_percent)
        self.key_hashes = dict(dep.key_hashes)
        keep = {rev for rev, _ in stored.roles()}
        records = self.store.engines()
        for rec in records:  # leftovers of a revision that was being stopped when the daemon died
            if rec.revision not in keep:
                if is_our_engine(rec.pid, rec.port, owner_tag(self.paths, rec.revision, rec.replica)):
                    await asyncio.to_thread(terminate, rec.pid, 5.0)
                self.store.forget_engine(rec.revision, rec.replica)
        for r in self.store.revisions():
            if r.state in rv.LIVE_STATES and r.id not in keep:
                self.store.set_revision_state(r.id, rv.RETIRED, "stopped while the daemon was down")
        rows = {r.id: r for r in self.store.revisions()}
        # written here without a move: the lock is held and no engine runs yet, so nothing else reads it
        self.traffic = tx.resumed(stored, list(rows.values()))
        for rev, _ in sorted(self.traffic.roles()):
            adopt = [e for e in records if e.revision == rev]
            self.supervisor.start_revision(rev, DeploymentSpec.model_validate(rows[rev].spec), adopt)
        self.save()
        self.publish()
        try:
            await self._serve_router(self.spec)
        except ListenError as e:  # reported again by the apply that follows
            log.error("%s", e)
        t = self.traffic
        self.event(
            "recover", f"resumed from state.db: stable {t.stable}, candidate {t.candidate} at {t.percent:g}%"
        )

    async def _serve_router(self, spec: DeploymentSpec) -> None:
        from llmdeploy.router.app import create_router  # the router is heavy; only the daemon needs it

        if self.router is None:
            self.router = create_router(spec, self.table, generated_key_hashes=self.key_hashes)
            self.router.set_control_feed(self.status)  # /dashboard shows events, revision states, replicas
            await self.router.start()  # engine pool poller; the listener runs with lifespan off (re-listen)
        if self.listener is None:
            self.listener = await open_router_listener(self.router.app, spec, DRAIN_S)
            log.info("router listening on %s", router_url(spec))

    # ---- apply ---------------------------------------------------------------------------------------------

    async def apply(self, req: ApplyRequest) -> dict[str, Any]:
        new = DeploymentSpec.model_validate(req.spec)
        async with self.lock:
            if refusal := unsupported(new):
                raise ControlError(refusal, 400)
            mirror_env(req.env, referenced_env(new))
            diff = diff_specs(self.spec, new)
            keys_changed = req.key_hashes != self.key_hashes
            needs_revision = diff.new_revision or self.traffic.stable is None
            roll_forward = needs_revision and not diff.created and not req.force
            if roll_forward and (refusal := tx.refuse_roll_forward(self.snapshot(), new)):
                raise ControlError(refusal.message, refusal.status)
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
            revision, share = None, None
            if needs_revision:
                started = await self._carry_out(tx.start_revision(self.snapshot(), new, origin="apply"))
                revision = started["revision"]
            elif moved := tx.reapply_canary_percent(self.snapshot(), old):
                share = await self._carry_out(moved)
            self.save()
            self.publish()
            starting = f": revision {revision} starting" if revision else ""
            changes = {"changes": [c.path for c in diff.changes][:50]}
            self.event("apply", f"{diff.summary()}{starting}", revision, changes)
            result = self._apply_result(diff.summary(), diff, revision)
            return {**result, "canary": share} if share else result

    def _apply_result(self, summary: str, diff: Any, revision: int | None = None) -> dict[str, Any]:
        stable = self.traffic.stable
        return {"result": summary, "revision": revision, "diff": diff.to_json(), "stable": stable}

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

    # ---- the supervisor's news: a revision became ready or failed ------------------------------------------

    async def _reconcile(self) -> None:
        async with self.lock:
            # one revision at a time, each judged on a fresh snapshot: a failure waits for its engines to stop
            for rev, _ in self.traffic.roles():
                if move := tx.settle(self.snapshot(), rev):
                    await self._carry_out(move)
            self.publish()

    # ---- traffic by hand (the admin API) and by the watcher ------------------------------------------------

    async def canary(self, percent: float) -> dict[str, Any]:
        async with self.lock:
            return await self._carry_out(tx.set_canary_share(self.snapshot(), percent))

    async def promote(self) -> dict[str, Any]:
        async with self.lock:
            return await self._carry_out(tx.promote(self.snapshot()))

    async def rollback(self, to_revision: int | None = None) -> dict[str, Any]:
        async with self.lock:
            return await self._carry_out(tx.roll_back(self.snapshot(), to_revision))

    async def auto_rollback(self, decision: RollbackDecision, revision: int) -> dict[str, Any]:
        async with self.lock:
            return await self._carry_out(tx.auto_roll_back(self.snapshot(), decision, revision))

    def _watched_candidate(self) -> WatchedCandidate | None:
        """The candidate to judge: one that takes traffic (ready or serving) while the router runs."""
        rev, spec = self.traffic.candidate, self.spec
        if rev is None or spec is None or self.router is None:
            return None
        if self.state_of(rev) not in (rv.READY, rv.SERVING):
            return None
        return WatchedCandidate(rev, self.router.revision_window(rev), spec.rollout.auto_rollback)

    async def watch_candidate(self, period_s: float = 1.0) -> None:
        await self.watcher.run(period_s)

    # ---- autoscaling: the autoscaler's decision, carried out like any move ---------------------------------

    async def scale(self, revision: int, decision: Decision, judged_replicas: int) -> dict[str, Any]:
        async with self.lock:
            return await self._carry_out(tx.scale(self.snapshot(), revision, decision, judged_replicas))

    async def autoscale(self, period_s: float = 1.0) -> None:
        await self.autoscaler.run(period_s)

    @property
    def scaling(self) -> dict[str, Any] | None:
        """The stable revision's replica range and the autoscaler's last decision (status shows it)."""
        return self.autoscaler.status(self)

    # ---- status and shutdown -------------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
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
