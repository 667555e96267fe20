"""The autoscaler (ARCHITECTURE.md §8): about once a second it observes the stable revision of a deployment whose
`parallel.replicas` is a range, asks policies/autoscale.py, and hands an up or a down to the controller, which
carries out transitions.scale under its lock (and does nothing if the stable revision or its replica count moved
since the observation).

It changes nothing itself, like the auto-rollback watcher. It keeps what the policy needs between ticks: the
streaks of the revision it judges, and samples of the router's request and spill counters, which it turns into
the spill share over the window. The engines' signals are the router's last /load of each replica (polled every
0.2 s for routing already), so nothing here talks to an engine.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmdeploy.control import revisions as rv
from llmdeploy.control.periodic import every
from llmdeploy.control.status import LiveControl
from llmdeploy.policies.autoscale import (
    SPILL_REASONS,
    Action,
    Decision,
    Limits,
    Observation,
    ReplicaSignals,
    Streaks,
    decide,
)

if TYPE_CHECKING:
    from llmdeploy.control.supervisor import Replica


@dataclass(frozen=True)
class Subject:
    """The stable revision of an autoscaled deployment, as one tick sees it."""

    revision: int
    replicas: int  # supervised now, starting ones included
    limits: Limits
    ready: tuple[ReplicaSignals, ...]
    last_failed_start: float | None
    answered: int  # the router's counters since it started: requests answered (local + cloud) ...
    spilled: int  # ... and sent to the cloud for load


def observe(c: LiveControl, now: float) -> Subject | None:
    """None when there is nothing to scale: no stable serving revision, a fixed replica count, no router."""
    rev, spec, router = c.traffic.stable, c.spec, c.router
    reps = c.supervisor.replicas.get(rev) if rev is not None else None
    if rev is None or spec is None or router is None or not reps:
        return None
    scale_range = reps[0].spec.parallel.autoscale  # the revision's own setting: parallel makes a new revision
    row = c.store.revision(rev) if scale_range is not None else None
    if scale_range is None or row is None or row.state != rv.SERVING:
        return None
    limits = Limits(
        scale_range.min,
        scale_range.max,
        scale_range.scale_up_after_s,
        scale_range.cool_down_s,
        spec.routing.overflow.max_queue_depth,
    )
    ready = _ready_signals(router, rev, reps, now, spec.sla.ttft_p99_ms)
    answered, spilled = _router_counts(router)
    failed = c.supervisor.failed_adds.get(rev)
    return Subject(rev, len(reps), limits, ready, failed, answered, spilled)


def _ready_signals(
    router: Any, rev: int, reps: list[Replica], now: float, ttft_p99_ms: float
) -> tuple[ReplicaSignals, ...]:
    """The replicas the supervisor calls ready, in its order, as the router's last /load of each shows them."""
    routed = next((r for r in router.pool.revision_states(now) if r.revision == rev), None)
    by_name = {r.replica: r for r in routed.replicas} if routed else {}
    seen = (by_name.get(r.name) if r.ready else None for r in reps)
    return tuple(
        s for s in (ReplicaSignals.of(r, ttft_p99_ms) for r in seen if r is not None) if s is not None
    )


def _router_counts(router: Any) -> tuple[int, int]:
    """(answered, spilled for load) since the router started, from the counters its status shows."""
    counts = router.snapshot()
    answered = sum((counts.get("requests") or {}).values())
    spilled = sum(n for reason, n in (counts.get("overflow") or {}).items() if reason in SPILL_REASONS)
    return int(answered), int(spilled)


class SpillWindow:
    """The router's cumulative counters, sampled each tick, as (spilled, answered) over the last window."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int, int]] = deque()

    def over(self, now: float, window_s: float, answered: int, spilled: int) -> tuple[int, int]:
        if self.samples and (answered < self.samples[-1][1] or spilled < self.samples[-1][2]):
            self.samples.clear()  # a new router: its counters started again
        self.samples.append((now, answered, spilled))
        while len(self.samples) > 1 and self.samples[1][0] <= now - window_s:
            self.samples.popleft()  # the oldest kept sample is the last one at or before the window's start
        _, answered0, spilled0 = self.samples[0]
        return spilled - spilled0, answered - answered0


class Autoscaler:
    def __init__(
        self,
        observe: Callable[[float], Subject | None],
        scale: Callable[[int, Decision, int], Awaitable[object]],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.observe, self.scale, self.clock = observe, scale, clock
        self.streaks: dict[int, Streaks] = {}
        self.window = SpillWindow()
        self.subject: Subject | None = None
        self.decision: Decision | None = None

    async def run(self, period_s: float = 1.0) -> None:
        await every(period_s, self.tick, "autoscaling check")

    async def tick(self) -> None:
        now = self.clock()
        subject = self.subject = self.observe(now)
        if subject is None:
            self.decision = None
            return
        spilled, answered = self.window.over(
            now, subject.limits.spill_window_s, subject.answered, subject.spilled
        )
        obs = Observation(now, subject.replicas, subject.ready, spilled, answered, subject.last_failed_start)
        decision = decide(obs, subject.limits, self.streaks.get(subject.revision, Streaks()))
        self.streaks = {subject.revision: decision.streaks}  # a new stable revision starts afresh
        self.decision = decision
        if decision.action != Action.HOLD:
            await self.scale(subject.revision, decision, subject.replicas)

    def status(self, c: LiveControl) -> dict[str, Any] | None:
        """For status: the stable revision's replicas and range, and the last decision about it with its
        reason (None: a fixed count)."""
        rev = c.traffic.stable
        reps = c.supervisor.replicas.get(rev) if rev is not None else None
        scale_range = reps[0].spec.parallel.autoscale if reps else None
        if rev is None or not reps or scale_range is None:
            return None
        d = self.decision if self.subject is not None and self.subject.revision == rev else None
        return {
            "revision": rev,
            "replicas": len(reps),
            "ready": sum(r.ready for r in reps),
            "min": scale_range.min,
            "max": scale_range.max,
            "decision": None if d is None else {"action": str(d.action), "reason": d.reason},
        }
