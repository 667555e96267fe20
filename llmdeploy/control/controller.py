"""The control plane inside the daemon: applies specs, moves traffic between revisions, rolls back.

One asyncio lock serialises every operation (admin calls and the automatic rollback). The in-memory state
(applied spec, stable/candidate revision, split) is written to state.db after each change, so a new daemon
resumes exactly where a killed one stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from pydantic import BaseModel, Field

from llmdeploy.control import revisions as rv
from llmdeploy.control.diff import diff_specs
from llmdeploy.control.keys import referenced_env
from llmdeploy.control.listener import Listener, ListenError, open_router_listener, router_url
from llmdeploy.control.paths import DeploymentPaths
from llmdeploy.control.state import StateStore
from llmdeploy.control.supervisor import Supervisor, is_our_engine, owner_tag, terminate, unsupported
from llmdeploy.policies.rollback import RollbackDecision, judge_candidate
from llmdeploy.router.table import EngineEndpoint, RevisionRoute, RoutingTable
from llmdeploy.spec.models import DeploymentSpec

log = logging.getLogger("llmdeploy.control")
DRAIN_S = 30.0


class ControlError(Exception):
    """An operation refused or failed; the message is shown to the user as is."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.message, self.status = message, status


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
        self.judgement: RollbackDecision | None = None
        self._reconcile_task: asyncio.Task | None = None

    # ---- bookkeeping --------------------------------------------------------------------------------------

    def event(self, kind: str, message: str, revision: int | None = None, data: dict | None = None) -> None:
        self.store.add_event(kind, message, revision, data)
        log.info("[%s]%s %s", kind, f" rev {revision}" if revision else "", message)

    def _save(self) -> None:
        self.store.update_deployment(
            spec=rv.spec_dict(self.spec) if self.spec else None, stable=self.stable, candidate=self.candidate,
            candidate_percent=self.percent, key_hashes=self.key_hashes,
        )  # fmt: skip

    def _publish(self) -> None:
        """Swap the router's table: revisions, their share, and which engines are ready now."""
        shares = rv.split(self.stable, self.candidate, self.percent)
        routes = []
        for rev, role in ((self.stable, "stable"), (self.candidate, "candidate")):
            if rev is None:
                continue
            engines = [EngineEndpoint(r.url, r.name, r.ready) for r in self.supervisor.replicas.get(rev, [])]
            routes.append(RevisionRoute(rev, role, shares[rev], engines))
        self.table.swap(routes)

    def _engines_changed(self) -> None:
        self._publish()  # at once: an unready engine must leave the table before the next request
        if self._reconcile_task is None or self._reconcile_task.done():
            self._reconcile_task = asyncio.get_running_loop().create_task(self._reconcile())

    def _state(self, rev: int) -> str:
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
        self._save()
        self._publish()
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
            if unsupported(new):
                raise ControlError(unsupported(new), 400)
            _set_env(req.env, referenced_env(new))
            diff = diff_specs(self.spec, new)
            keys_changed = req.key_hashes != self.key_hashes
            needs_revision = diff.new_revision or self.stable is None
            self._refuse_alias_change(new)
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
            revision = self._start_revision(new, origin="apply") if needs_revision else None
            self._save()
            self._publish()
            self.event(
                "apply", f"{diff.summary()}" + (f": revision {revision} starting" if revision else ""), revision,
                {"changes": [c.path for c in diff.changes][:50]},
            )  # fmt: skip
            return self._apply_result(diff.summary(), diff, revision)

    def _apply_result(self, summary: str, diff: Any, revision: int | None = None) -> dict[str, Any]:
        return {"result": summary, "revision": revision, "diff": diff.to_json(), "stable": self.stable}

    def _refuse_alias_change(self, new: DeploymentSpec) -> None:
        # engines answer only their own alias and the router forwards the client's name unchanged, so two
        # revisions with different aliases cannot share traffic: one side would answer 404
        stable = self.store.revision(self.stable) if self.stable else None
        old = stable.spec["model"]["served_alias"] if stable else None
        if old is not None and new.model.served_alias != old:
            raise ControlError(
                f"model.served_alias cannot change from {old!r} to {new.model.served_alias!r} in a gray release: "
                f"revision {stable.id} answers only {old!r}. Keep the alias, or serve the new one as its own "
                "deployment (another name and listen address)."
            )

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
        same_port = old is not None and spec.listen_port == _listen_port(old)
        if old is not None and same_port:
            await old.stop()
            self.listener = None
        self.listener = await open_router_listener(self.router.app, spec, DRAIN_S)
        if old is not None and not same_port:
            await old.stop()
        self.event("relisten", f"router now listening on {router_url(spec)}")

    def _start_revision(self, spec: DeploymentSpec, origin: str) -> int:
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
                state = self._state(rev)
                if phase == "failed" and state in rv.LIVE_STATES:
                    await self._revision_failed(rev)
                elif phase == "ready" and state == rv.STARTING:
                    self._revision_ready(rev)
            self._publish()

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
            self._promote(
                reason="rollback" if origin.startswith("rollback") else "rollout.canary_percent is 100"
            )
            return
        self.percent = spec.rollout.canary_percent
        self.store.set_revision_state(rev, rv.SERVING if self.percent > 0 else rv.READY)
        self._save()
        self.event("ready", f"candidate revision {rev} is ready; it takes {self.percent:g}% of traffic", rev)

    async def _revision_failed(self, rev: int) -> None:
        reason = next((r.phase for r in self.supervisor.replicas.get(rev, []) if r.failed), "engines failed")
        self.store.set_revision_state(rev, rv.FAILED, reason)
        if rev == self.candidate:
            self.candidate, self.percent = None, 0.0
        elif rev == self.stable:
            self.stable = None
        self._save()
        self._publish()
        self.event("failed", f"revision {rev} failed to start: {reason}", rev)
        await self.supervisor.stop_revision(rev, 5.0)
        if self.candidate is not None and self.stable is None:
            self.stable, self.candidate = self.candidate, None
            self._save()

    # ---- traffic ------------------------------------------------------------------------------------------

    def _candidate_ready(self, verb: str) -> int:
        if self.candidate is None:
            raise ControlError(
                f"cannot {verb}: there is no candidate revision (stable is {self.stable}). Apply a spec that "
                "changes model, engine or parallel to start one."
            )
        state = self._state(self.candidate)
        if state == rv.STARTING or self.supervisor.revision_phase(self.candidate) != "ready":
            phases = ", ".join(
                f"{r.name}: {r.phase}" for r in self.supervisor.replicas.get(self.candidate, [])
            )
            raise ControlError(
                f"cannot {verb}: candidate revision {self.candidate} is not ready yet ({phases}); "
                "watch it with `llmdeploy status`"
            )
        return self.candidate

    async def canary(self, percent: float) -> dict[str, Any]:
        if not 0 <= percent <= 100:
            raise ControlError("--percent must be between 0 and 100", 400)
        async with self.lock:
            rev = self._candidate_ready("set a canary share")
            if percent >= 100:
                return self._promote(reason="canary --percent 100")
            old, self.percent = self.percent, float(percent)
            self.store.set_revision_state(rev, rv.SERVING if percent > 0 else rv.READY)
            self._save()
            self._publish()
            self.event(
                "canary",
                f"candidate {rev}: {old:g}% -> {percent:g}% (stable {self.stable}: {100 - percent:g}%)",
                rev,
            )
            return {"result": "canary", "candidate": rev, "percent": percent, "stable": self.stable}

    async def promote(self) -> dict[str, Any]:
        async with self.lock:
            self._candidate_ready("promote")
            return self._promote(reason="promote")

    def _promote(self, reason: str) -> dict[str, Any]:
        rev, old = self.candidate, self.stable
        assert rev is not None
        self.stable, self.candidate, self.percent = rev, None, 0.0
        self.store.set_revision_state(rev, rv.SERVING)
        self.store.mark_served(rev)
        if old is not None:
            undone = self.store.revision(rev).origin.startswith("rollback")  # type: ignore[union-attr]
            self.store.set_revision_state(
                old,
                rv.ROLLED_BACK if undone else rv.RETIRED,
                f"undone by revision {rev}" if undone else f"replaced by revision {rev}",
            )
        self._save()
        self._publish()  # the old revision leaves the table before its engines get SIGTERM
        if old is not None:
            asyncio.get_running_loop().create_task(self.supervisor.stop_revision(old, DRAIN_S))
        self.event(
            "promote", f"revision {rev} takes 100% ({reason}); revision {old} stops", rev, {"previous": old}
        )
        return {"result": "promoted", "stable": rev, "retired": old}

    async def rollback(
        self, to_revision: int | None = None, decision: RollbackDecision | None = None
    ) -> dict[str, Any]:
        async with self.lock:
            if decision is not None and self.candidate is None:
                return {"result": "nothing to roll back"}
            if self.candidate is not None and to_revision in (None, self.stable):
                return await self._abort_candidate(decision)
            if self.candidate is not None:
                await self._abort_candidate(None)
            return self._undo(to_revision)

    async def _abort_candidate(self, decision: RollbackDecision | None) -> dict[str, Any]:
        rev, stable = self.candidate, self.stable
        assert rev is not None and self.spec is not None
        reason = f"automatic: {decision.reason}" if decision else "rollback by hand"
        self.candidate, self.percent = None, 0.0
        self._publish()  # stable takes 100% before the candidate's engines stop
        self.store.set_revision_state(rev, rv.ROLLED_BACK, reason)
        stable_row = self.store.revision(stable) if stable else None
        if stable_row:
            self.spec = rv.with_revision_of(self.spec, stable_row.spec)
        self._save()
        kind = "auto-rollback" if decision else "rollback"
        data = decision.numbers() if decision else {}
        self.event(kind, f"candidate {rev} rolled back, stable {stable} takes 100%: {reason}", rev, data)
        await self.supervisor.stop_revision(rev, DRAIN_S)
        return {"result": "rolled back", "rolled_back": rev, "stable": stable, "reason": reason}

    def _undo(self, to_revision: int | None) -> dict[str, Any]:
        """No canary: re-deploy an earlier revision's spec as a new revision (kubectl rollout undo)."""
        assert self.spec is not None
        try:
            target = rv.undo_target(self.store.revisions(), self.stable, to_revision)
        except rv.NoRollbackTarget as e:
            raise ControlError(str(e), 400 if e.bad_input else 409) from None
        self.spec = rv.with_revision_of(self.spec, target.spec)
        rev = self._start_revision(self.spec, origin=f"rollback to {target.id}")
        self._save()
        self._publish()
        self.event("rollback", f"re-deploying revision {target.id} as revision {rev}; it takes 100% once ready", rev,
                   {"to_revision": target.id, "from_revision": self.stable})  # fmt: skip
        return {"result": "rolling back", "revision": rev, "to_revision": target.id, "stable": self.stable}

    # ---- automatic rollback ----------------------------------------------------------------------------------

    async def watch_candidate(self, period_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await self._judge_once()
            except Exception:
                log.exception("auto-rollback check failed")

    async def _judge_once(self) -> None:
        rev, spec = self.candidate, self.spec
        if (
            rev is None
            or spec is None
            or self.router is None
            or self._state(rev) not in (rv.READY, rv.SERVING)
        ):
            self.judgement = None
            return
        self.judgement = judge_candidate(self.router.revision_window(rev), spec.rollout.auto_rollback)
        if self.judgement.rollback and rev == self.candidate:
            await self.rollback(decision=self.judgement)

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


def _set_env(values: dict[str, str | None], allowed: list[str]) -> None:
    # the router reads keys from the environment: mirror the caller's, so a hot reload sees what apply saw
    for name in allowed:
        value = values.get(name)
        if value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)


def _set_log_level(spec: DeploymentSpec) -> None:
    logging.getLogger("llmdeploy").setLevel(spec.logging.level.upper())


def _listen_port(listener: Listener) -> int | None:
    try:
        return listener.sock.getsockname()[1]
    except OSError:
        return None
