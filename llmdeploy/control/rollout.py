"""The automatic rollback's watcher (ARCHITECTURE.md §6): about once a second it judges the candidate's
sliding window against rollout.auto_rollback (policies/rollback.py) and, when the policy says so, asks for
the rollback.

It changes nothing itself: `watched` tells it what to judge, and `roll_back` is the controller's move, which
runs under the controller's lock and aborts the judged revision only if it is still the candidate (the
judgement is made without the lock). It keeps the last judgement, which `status` shows.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from llmdeploy.control.periodic import every
from llmdeploy.policies.rollback import RollbackDecision, judge_candidate
from llmdeploy.policies.snapshot import WindowStats
from llmdeploy.spec.models import AutoRollbackSpec


@dataclass(frozen=True)
class WatchedCandidate:
    """A candidate that takes traffic (ready or serving), with the window of the requests it served itself."""

    revision: int
    window: WindowStats
    limits: AutoRollbackSpec


class AutoRollbackWatcher:
    def __init__(
        self,
        watched: Callable[[], WatchedCandidate | None],
        roll_back: Callable[[RollbackDecision, int], Awaitable[object]],
    ):
        self.watched, self.roll_back = watched, roll_back
        self.judgement: RollbackDecision | None = None

    async def run(self, period_s: float = 1.0) -> None:
        await every(period_s, self.judge_once, "auto-rollback check")

    async def judge_once(self) -> None:
        candidate = self.watched()
        if candidate is None:
            self.judgement = None
            return
        self.judgement = judge_candidate(candidate.window, candidate.limits)
        if self.judgement.rollback:
            await self.roll_back(self.judgement, candidate.revision)
