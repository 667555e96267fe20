"""Moving traffic between the stable and the candidate revision: canary share, promote, roll back.

Also the automatic rollback: a watcher judges the candidate's sliding window every second and aborts it when
the policy says so. Every operation runs under the controller's lock and changes the controller's revision
state (stable, candidate, percent, spec), so a Rollout is a part of one Controller, not a service of its own:
it keeps only the last judgement, which `status` shows.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from llmdeploy.control import revisions as rv
from llmdeploy.control.errors import ControlError
from llmdeploy.policies.rollback import RollbackDecision, judge_candidate

if TYPE_CHECKING:
    from llmdeploy.control.controller import Controller

log = logging.getLogger("llmdeploy.control")


class Rollout:
    def __init__(self, controller: Controller, drain_s: float):
        self.c = controller
        self.drain_s = drain_s  # how long a revision that leaves the table may finish its in-flight requests
        self.judgement: RollbackDecision | None = None

    # ---- by hand ----------------------------------------------------------------------------------------------

    async def canary(self, percent: float) -> dict[str, Any]:
        if not 0 <= percent <= 100:
            raise ControlError("--percent must be between 0 and 100", 400)
        c = self.c
        async with c.lock:
            rev = self._candidate_ready("set a canary share")
            if percent >= 100:
                return self.promote_candidate(reason="canary --percent 100")
            old, c.percent = c.percent, float(percent)
            c.store.set_revision_state(rev, rv.SERVING if percent > 0 else rv.READY)
            c.save()
            c.publish()
            c.event(
                "canary",
                f"candidate {rev}: {old:g}% -> {percent:g}% (stable {c.stable}: {100 - percent:g}%)",
                rev,
            )
            return {"result": "canary", "candidate": rev, "percent": percent, "stable": c.stable}

    async def promote(self) -> dict[str, Any]:
        async with self.c.lock:
            self._candidate_ready("promote")
            return self.promote_candidate(reason="promote")

    async def rollback(
        self, to_revision: int | None = None, decision: RollbackDecision | None = None
    ) -> dict[str, Any]:
        c = self.c
        async with c.lock:
            if decision is not None and c.candidate is None:
                return {"result": "nothing to roll back"}
            if c.candidate is not None and to_revision in (None, c.stable):
                return await self._abort_candidate(decision)
            if c.candidate is not None:
                await self._abort_candidate(None)
            return self._undo(to_revision)

    def _candidate_ready(self, verb: str) -> int:
        c = self.c
        if c.candidate is None:
            raise ControlError(
                f"cannot {verb}: there is no candidate revision (stable is {c.stable}). Apply a spec that "
                "changes model, engine or parallel to start one."
            )
        state = c.state_of(c.candidate)
        if state == rv.STARTING or c.supervisor.revision_phase(c.candidate) != "ready":
            phases = ", ".join(f"{r.name}: {r.phase}" for r in c.supervisor.replicas.get(c.candidate, []))
            raise ControlError(
                f"cannot {verb}: candidate revision {c.candidate} is not ready yet ({phases}); "
                "watch it with `llmdeploy status`"
            )
        return c.candidate

    def promote_candidate(self, reason: str) -> dict[str, Any]:
        """The candidate becomes stable at 100%. The caller holds the lock (the controller calls this too)."""
        c = self.c
        rev, old = c.candidate, c.stable
        assert rev is not None
        c.stable, c.candidate, c.percent = rev, None, 0.0
        c.store.set_revision_state(rev, rv.SERVING)
        c.store.mark_served(rev)
        if old is not None:
            undone = c.store.revision(rev).origin.startswith("rollback")  # type: ignore[union-attr]
            c.store.set_revision_state(
                old,
                rv.ROLLED_BACK if undone else rv.RETIRED,
                f"undone by revision {rev}" if undone else f"replaced by revision {rev}",
            )
        c.save()
        c.publish()  # the old revision leaves the table before its engines get SIGTERM
        if old is not None:
            asyncio.get_running_loop().create_task(c.supervisor.stop_revision(old, self.drain_s))
        c.event(
            "promote", f"revision {rev} takes 100% ({reason}); revision {old} stops", rev, {"previous": old}
        )
        return {"result": "promoted", "stable": rev, "retired": old}

    async def _abort_candidate(self, decision: RollbackDecision | None) -> dict[str, Any]:
        c = self.c
        rev, stable = c.candidate, c.stable
        assert rev is not None and c.spec is not None
        reason = f"automatic: {decision.reason}" if decision else "rollback by hand"
        c.candidate, c.percent = None, 0.0
        c.publish()  # stable takes 100% before the candidate's engines stop
        c.store.set_revision_state(rev, rv.ROLLED_BACK, reason)
        stable_row = c.store.revision(stable) if stable else None
        if stable_row:
            c.spec = rv.with_revision_of(c.spec, stable_row.spec)
        c.save()
        kind = "auto-rollback" if decision else "rollback"
        data = decision.numbers() if decision else {}
        c.event(kind, f"candidate {rev} rolled back, stable {stable} takes 100%: {reason}", rev, data)
        await c.supervisor.stop_revision(rev, self.drain_s)
        return {"result": "rolled back", "rolled_back": rev, "stable": stable, "reason": reason}

    def _undo(self, to_revision: int | None) -> dict[str, Any]:
        """No canary: re-deploy an earlier revision's spec as a new revision (kubectl rollout undo)."""
        c = self.c
        assert c.spec is not None
        try:
            target = rv.undo_target(c.store.revisions(), c.stable, to_revision)
        except rv.NoRollbackTarget as e:
            raise ControlError(str(e), 400 if e.bad_input else 409) from None
        c.spec = rv.with_revision_of(c.spec, target.spec)
        rev = c.start_revision(c.spec, origin=f"rollback to {target.id}")
        c.save()
        c.publish()
        c.event("rollback", f"re-deploying revision {target.id} as revision {rev}; it takes 100% once ready", rev,
                {"to_revision": target.id, "from_revision": c.stable})  # fmt: skip
        return {"result": "rolling back", "revision": rev, "to_revision": target.id, "stable": c.stable}

    # ---- automatic ----------------------------------------------------------------------------------------------

    async def watch(self, period_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await self._judge_once()
            except Exception:
                log.exception("auto-rollback check failed")

    async def _judge_once(self) -> None:
        c = self.c
        rev, spec = c.candidate, c.spec
        if rev is None or spec is None or c.router is None or c.state_of(rev) not in (rv.READY, rv.SERVING):
            self.judgement = None
            return
        self.judgement = judge_candidate(c.router.revision_window(rev), spec.rollout.auto_rollback)
        if self.judgement.rollback and rev == c.candidate:
            await self.rollback(decision=self.judgement)
