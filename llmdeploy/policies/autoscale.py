"""When to add or remove a replica of the stable revision (`parallel.replicas: {min, max}`; ARCHITECTURE.md §8).

One pure decision per tick over an `Observation`: the ready replicas' own /load signals (predicted TTFT for a
normal prompt against its SLA target, queue, KV usage), the share of requests the router spilled to the cloud
for load over the last window, and how many replicas the revision has. The caller keeps the `Streaks` the
decision returns and hands them back on the next tick, so "sustained" is judged here without a clock:

  up    the SLA has been at risk for scale_up_after_s, every replica ready, fewer than max
  down  idle (one replica fewer would still be at most half busy) for cool_down_s, the last change at least
        cool_down_s ago, more than min; the least busy replica drains
  hold  anything else, with the reason (a replica starting, at max, at min, not long enough, steady)

One step at a time: nothing is judged while a replica starts, and every change starts the streaks afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from llmdeploy.policies import overflow as ov
from llmdeploy.policies.snapshot import ReplicaState

REFERENCE_PROMPT_TOKENS = 512  # "a normal prompt": what `llmdeploy plan` assumes unless told
KV_AT_RISK = 0.9  # past this on every replica new sequences soon wait for blocks (or preempt)
SPILL_AT_RISK = 0.1  # the share of requests spilled to the cloud for load over the window
MIN_WINDOW_REQUESTS = 5  # a share of fewer requests is noise
# the spill reasons a replica more would fix (burst is a configured rate, capability and local_down are not load)
SPILL_REASONS = (ov.PREDICTED_TTFT, ov.TPOT, ov.KV_BLOCKS, ov.QUEUE_DEPTH)
SPILL_WINDOW_S = (5.0, 60.0)  # the spill share's window: scale_up_after_s, within these bounds
QUIET = 0.5  # down only if one replica fewer would still be at most this busy (slots, KV, TTFT vs target)


class Action(StrEnum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


@dataclass(frozen=True)
class ReplicaSignals:
    """One ready replica as the autoscaler sees it (from the router's last /load of it)."""

    name: str
    predicted_ttft_ms: float  # for REFERENCE_PROMPT_TOKENS under its queue and the router's unseen requests
    ttft_target_ms: float  # sla.ttft_p99_ms, or the engine's scaled deadline when the prompt alone is longer
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    max_num_seqs: int = 0

    @classmethod
    def of(cls, replica: ReplicaState, ttft_p99_ms: float) -> ReplicaSignals | None:
        """None when the router holds no fresh /load of it."""
        load = replica.load
        if load is None:
            return None
        n = REFERENCE_PROMPT_TOKENS
        return cls(
            replica.replica,
            ov.predicted_ttft_ms(load, n, replica.inflight),
            ov.ttft_target_ms(load, n, ttft_p99_ms),
            load.waiting,
            max(load.running, replica.inflight - load.waiting),
            load.kv_usage,
            load.max_num_seqs,
        )


@dataclass(frozen=True)
class Observation:
    now: float  # monotonic seconds
    replicas: int  # the revision's replicas, starting and restarting ones included
    ready: tuple[ReplicaSignals, ...] = ()  # ready replicas with a fresh /load
    spilled: int = 0  # requests the router sent to the cloud for load (predicted TTFT, TPOT, KV, queue) ...
    requests: int = 0  # ... out of all it answered, over the window
    last_failed_start: float | None = None  # when an added replica last gave up before becoming ready

    @property
    def spill_share(self) -> float:
        return self.spilled / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class Limits:
    min: int
    max: int
    scale_up_after_s: float
    cool_down_s: float
    max_queue_depth: int  # routing.overflow.max_queue_depth: the router spills past it

    @property
    def queue_at_risk(self) -> int:
        return max(1, self.max_queue_depth // 2)

    @property
    def spill_window_s(self) -> float:
        low, high = SPILL_WINDOW_S
        return min(max(self.scale_up_after_s, low), high)


@dataclass(frozen=True)
class Streaks:
    """What the decision remembers between ticks (the caller stores it, one per revision)."""

    at_risk_since: float | None = None
    idle_since: float | None = None
    last_change: float | None = None  # the revision's start counts: no replica is removed right after it


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    streaks: Streaks
    replica: str | None = None  # DOWN: the one to drain


def decide(obs: Observation, limits: Limits, streaks: Streaks) -> Decision:
    now = obs.now
    if streaks.last_change is None:
        streaks = replace(streaks, last_change=now)
    if obs.replicas < limits.min:  # never expected (a revision starts at min): back into the range
        return _change(Action.UP, f"{obs.replicas} replicas, below min {limits.min}", now)
    if obs.replicas > limits.max and obs.ready:
        leaving = _least_busy(obs.ready).name
        return _change(Action.DOWN, f"{obs.replicas} replicas, above max {limits.max}", now, leaving)
    if len(obs.ready) < obs.replicas:
        waiting = obs.replicas - len(obs.ready)
        why = f"{waiting} of {obs.replicas} replicas not ready yet: one step at a time"
        return _hold(why, Streaks(last_change=streaks.last_change))
    risk, busy = at_risk(obs, limits), not_idle(obs)
    streaks = Streaks(
        (streaks.at_risk_since if streaks.at_risk_since is not None else now) if risk else None,
        (streaks.idle_since if streaks.idle_since is not None else now) if busy is None else None,
        streaks.last_change,
    )
    if risk:
        return _judge_up(obs, limits, streaks, risk)
    if busy is None:
        return _judge_down(obs, limits, streaks)
    return _hold(f"steady: {busy}", streaks)


def _judge_up(obs: Observation, limits: Limits, streaks: Streaks, risk: str) -> Decision:
    now = obs.now
    if obs.replicas >= limits.max:
        return _hold(f"SLA at risk ({risk}) but already at max ({_count(limits.max)})", streaks)
    failed = obs.last_failed_start
    if failed is not None and now - failed < limits.cool_down_s:
        why = f"an added replica failed to start {now - failed:.0f}s ago; none is added for cool_down_s"
        return _hold(f"SLA at risk ({risk}) but {why}", streaks)
    assert streaks.at_risk_since is not None
    held = now - streaks.at_risk_since
    if held < limits.scale_up_after_s:
        return _hold(f"SLA at risk for {held:.0f}s of {limits.scale_up_after_s:g}s: {risk}", streaks)
    return _change(Action.UP, f"SLA at risk for {held:.0f}s: {risk}", now)


def _judge_down(obs: Observation, limits: Limits, streaks: Streaks) -> Decision:
    now = obs.now
    if obs.replicas <= limits.min:
        return _hold(f"idle at min ({_count(limits.min)})", streaks)
    assert streaks.idle_since is not None and streaks.last_change is not None
    idle = now - streaks.idle_since
    if idle < limits.cool_down_s:
        return _hold(f"idle for {idle:.0f}s of cool_down_s {limits.cool_down_s:g}s", streaks)
    since = now - streaks.last_change
    if since < limits.cool_down_s:
        return _hold(
            f"idle, but the last change was {since:.0f}s ago (cool_down_s {limits.cool_down_s:g}s)", streaks
        )
    leaving = _least_busy(obs.ready)
    return _change(
        Action.DOWN,
        f"idle for {idle:.0f}s: {_count(obs.replicas - 1)} can carry the load",
        now,
        leaving.name,
    )


def at_risk(obs: Observation, limits: Limits) -> str | None:
    """Why the SLA is at risk now, or None. Every replica must be short of room: the router sends a request to
    any replica that can take it, so one with room left still serves the SLA."""
    ready = obs.ready
    if ready and all(r.predicted_ttft_ms > r.ttft_target_ms for r in ready):
        best = min(ready, key=lambda r: r.predicted_ttft_ms)
        return (
            f"predicted TTFT of a {REFERENCE_PROMPT_TOKENS}-token prompt is {best.predicted_ttft_ms:.0f} ms even on "
            f"{best.name}, over its target {best.ttft_target_ms:.0f} ms"
        )
    if ready and all(r.waiting >= limits.queue_at_risk for r in ready):
        return f"every replica queues {limits.queue_at_risk}+ requests (max_queue_depth {limits.max_queue_depth})"
    if ready and all(r.kv_usage >= KV_AT_RISK for r in ready):
        return f"KV cache over {KV_AT_RISK:.0%} on every replica"
    if obs.requests >= MIN_WINDOW_REQUESTS and obs.spill_share >= SPILL_AT_RISK:
        return f"{obs.spill_share:.0%} of requests ({obs.spilled} of {obs.requests}) spilled to the cloud for load"
    return None


def not_idle(obs: Observation) -> str | None:
    """Why one replica fewer could not carry the load at most QUIET busy, or None (idle)."""
    ready, fewer = obs.ready, max(1, len(obs.ready) - 1)
    if obs.spilled:
        return f"{obs.spilled} requests spilled to the cloud for load over the window"
    if any(r.waiting for r in ready):
        return "requests are queued"
    slots = sum(r.max_num_seqs for r in ready) / max(1, len(ready)) * fewer
    running = sum(r.running for r in ready)
    if slots and running > QUIET * slots:
        return f"{running} sequences running: {_count(fewer)} would be over {QUIET:.0%} of {slots:.0f} slots"
    kv = sum(r.kv_usage for r in ready)
    if kv > QUIET * fewer:
        return f"KV usage adds up to {kv:.0%} of one replica: {_count(fewer)} would be over {QUIET:.0%}"
    if hot := [r.name for r in ready if r.predicted_ttft_ms > QUIET * r.ttft_target_ms]:
        return f"predicted TTFT over {QUIET:.0%} of its target on {', '.join(hot)}"
    return None


def _least_busy(ready: tuple[ReplicaSignals, ...]) -> ReplicaSignals:
    """The replica whose drain ends soonest; among equals the last one (the newest)."""
    return min(reversed(ready), key=lambda r: (r.running + r.waiting, r.kv_usage))


def _count(n: int) -> str:
    return f"{n} replica" if n == 1 else f"{n} replicas"


def _hold(reason: str, streaks: Streaks) -> Decision:
    return Decision(Action.HOLD, reason, streaks)


def _change(action: Action, reason: str, now: float, replica: str | None = None) -> Decision:
    return Decision(action, reason, Streaks(last_change=now), replica)
