"""The autoscaling decision (policies/autoscale.py) as a pure function: every reason to act and every refusal,
table by table, without a process."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmdeploy.policies import autoscale as au
from llmdeploy.policies.autoscale import Action, Limits, Observation, ReplicaSignals, Streaks, decide
from llmdeploy.policies.snapshot import EngineLoad, ReplicaState

LIMITS = Limits(min=1, max=3, scale_up_after_s=10, cool_down_s=60, max_queue_depth=8)
T = 1000.0  # now, in monotonic seconds

IDLE = ReplicaSignals("r1", predicted_ttft_ms=50, ttft_target_ms=1000, max_num_seqs=16)
SLOW = replace(IDLE, predicted_ttft_ms=1500)  # a normal prompt would miss the SLA here
QUEUED = replace(IDLE, waiting=4, running=16)  # queue_at_risk is 8 // 2
FULL_KV = replace(IDLE, kv_usage=0.95, running=10)
BUSY = replace(IDLE, running=12, kv_usage=0.3)  # no risk, but not idle either


def named(*signals: ReplicaSignals) -> tuple[ReplicaSignals, ...]:
    return tuple(replace(s, name=f"r{i + 1}") for i, s in enumerate(signals))


def obs(*ready: ReplicaSignals, replicas: int | None = None, **kw) -> Observation:
    ready = named(*ready)
    return Observation(T, len(ready) if replicas is None else replicas, ready, **kw)


RISK_FOR_LONG = Streaks(at_risk_since=T - 11, last_change=T - 100)
IDLE_FOR_LONG = Streaks(idle_since=T - 61, last_change=T - 100)

# (observation, streaks, action, a fragment of the reason)
CASES = {
    "up: every replica misses the SLA, long enough": (
        obs(SLOW, SLOW),
        RISK_FOR_LONG,
        Action.UP,
        "SLA at risk for 11s: predicted TTFT of a 512-token prompt is 1500 ms",
    ),
    "up: every replica queues": (obs(QUEUED), RISK_FOR_LONG, Action.UP, "every replica queues 4+ requests"),
    "up: KV full everywhere": (obs(FULL_KV, FULL_KV), RISK_FOR_LONG, Action.UP, "KV cache over 90%"),
    "up: the router spills to the cloud": (
        obs(IDLE, spilled=3, requests=20),
        RISK_FOR_LONG,
        Action.UP,
        "15% of requests (3 of 20) spilled to the cloud for load",
    ),
    "up: below min (back into the range)": (obs(IDLE, replicas=0), Streaks(), Action.UP, "below min 1"),
    "down: idle long enough": (
        obs(IDLE, IDLE),
        IDLE_FOR_LONG,
        Action.DOWN,
        "idle for 61s: 1 replica can carry the load",
    ),
    "down: above max": (obs(IDLE, IDLE, IDLE, IDLE), Streaks(), Action.DOWN, "4 replicas, above max 3"),
    # refusals: hold, and say why
    "hold: at risk, not long enough": (
        obs(SLOW),
        Streaks(at_risk_since=T - 4, last_change=T - 100),
        Action.HOLD,
        "SLA at risk for 4s of 10s",
    ),
    "hold: at risk from now on": (obs(SLOW), Streaks(), Action.HOLD, "SLA at risk for 0s of 10s"),
    "hold: at risk at max": (
        obs(SLOW, SLOW, SLOW),
        RISK_FOR_LONG,
        Action.HOLD,
        "already at max (3 replicas)",
    ),
    "hold: one replica still starting": (
        obs(SLOW, replicas=2),
        RISK_FOR_LONG,
        Action.HOLD,
        "1 of 2 replicas not ready",
    ),
    "hold: an added replica failed lately": (
        obs(SLOW, last_failed_start=T - 30),
        RISK_FOR_LONG,
        Action.HOLD,
        "an added replica failed to start 30s ago",
    ),
    "hold: only one of two replicas misses the SLA": (obs(SLOW, IDLE), RISK_FOR_LONG, Action.HOLD, "steady"),
    "hold: only one of two replicas queues": (
        obs(QUEUED, IDLE),
        RISK_FOR_LONG,
        Action.HOLD,
        "requests are queued",
    ),
    "hold: a few spills among few requests": (
        obs(BUSY, spilled=2, requests=4),
        RISK_FOR_LONG,
        Action.HOLD,
        "2 requests spilled to the cloud",
    ),
    "hold: idle at min": (obs(IDLE), IDLE_FOR_LONG, Action.HOLD, "idle at min (1 replica)"),
    "hold: idle, not long enough": (
        obs(IDLE, IDLE),
        Streaks(idle_since=T - 20, last_change=T - 100),
        Action.HOLD,
        "idle for 20s of cool_down_s 60s",
    ),
    "hold: idle, but the last change is recent": (
        obs(IDLE, IDLE),
        Streaks(idle_since=T - 61, last_change=T - 30),
        Action.HOLD,
        "the last change was 30s ago",
    ),
    "hold: idle right after the revision started": (
        obs(IDLE, IDLE),
        Streaks(idle_since=T - 61),
        Action.HOLD,
        "the last change was 0s ago",
    ),
    "hold: one fewer would be over half its slots": (
        obs(BUSY, BUSY),
        IDLE_FOR_LONG,
        Action.HOLD,
        "24 sequences running: 1 replica would be over 50% of 16 slots",
    ),
    "hold: KV adds up to more than half a replica": (
        obs(replace(IDLE, kv_usage=0.3), replace(IDLE, kv_usage=0.3)),
        IDLE_FOR_LONG,
        Action.HOLD,
        "KV usage adds up to 60%",
    ),
    "hold: predicted TTFT over half its target": (
        obs(IDLE, replace(IDLE, predicted_ttft_ms=600)),
        IDLE_FOR_LONG,
        Action.HOLD,
        "predicted TTFT over 50% of its target on r2",
    ),
    "hold: spills in the window keep it from idling": (
        obs(IDLE, IDLE, spilled=1, requests=40),
        IDLE_FOR_LONG,
        Action.HOLD,
        "1 requests spilled",
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_decision(case):
    observation, streaks, action, fragment = CASES[case]
    d = decide(observation, LIMITS, streaks)
    assert d.action == action and fragment in d.reason, d.reason


def test_down_drains_the_least_busy_replica_and_the_newest_among_equals():
    d = decide(obs(replace(IDLE, running=2), IDLE, replace(IDLE, running=1)), LIMITS, IDLE_FOR_LONG)
    assert (d.action, d.replica) == (Action.DOWN, "r2")
    d = decide(obs(IDLE, IDLE, IDLE), LIMITS, IDLE_FOR_LONG)
    assert (d.action, d.replica) == (Action.DOWN, "r3")


def test_a_change_starts_the_streaks_afresh_and_counts_as_the_last_change():
    for observation, streaks in ((obs(SLOW), RISK_FOR_LONG), (obs(IDLE, IDLE), IDLE_FOR_LONG)):
        d = decide(observation, LIMITS, streaks)
        assert d.action != Action.HOLD and d.streaks == Streaks(last_change=T)


def test_streaks_carry_over_ticks_and_end_with_their_condition():
    first = decide(obs(SLOW), LIMITS, Streaks())
    assert first.streaks == Streaks(at_risk_since=T, last_change=T)
    later = decide(replace(obs(SLOW), now=T + 10), LIMITS, first.streaks)
    assert later.action == Action.UP
    calm = decide(replace(obs(BUSY), now=T + 5), LIMITS, first.streaks)
    assert calm.action == Action.HOLD and calm.streaks == Streaks(last_change=T)
    idle = decide(obs(IDLE), LIMITS, Streaks(last_change=T - 5))
    assert idle.streaks.idle_since == T and idle.streaks.at_risk_since is None


def test_a_starting_replica_resets_both_streaks():
    d = decide(
        obs(SLOW, replicas=2), LIMITS, Streaks(at_risk_since=T - 50, idle_since=T - 50, last_change=T - 9)
    )
    assert d.streaks == Streaks(last_change=T - 9)


def test_never_outside_the_range_over_many_ticks():
    """Driven tick by tick, under constant load then none: one step per change, between min and max."""
    replicas, streaks, counts = 1, Streaks(), []
    for t in range(0, 600, 1):
        ready = named(*([SLOW] * replicas)) if t < 300 else named(*([IDLE] * replicas))
        d = decide(Observation(float(t), replicas, ready), LIMITS, streaks)
        streaks = d.streaks
        replicas += {Action.UP: 1, Action.DOWN: -1, Action.HOLD: 0}[d.action]
        counts.append(replicas)
    assert max(counts) == LIMITS.max and counts[-1] == LIMITS.min
    assert all(abs(a - b) <= 1 for a, b in zip(counts, counts[1:], strict=False))
    assert all(LIMITS.min <= c <= LIMITS.max for c in counts)


def test_signals_come_from_the_routers_view_of_a_replica():
    ladder = ((16.0, 20.0), (512.0, 400.0), (2048.0, 1600.0))
    load = EngineLoad(waiting=2, running=5, kv_usage=0.4, max_num_seqs=8, ttft_ms_by_prompt_len=ladder)
    s = ReplicaSignals.of(ReplicaState("http://a", "r1", 1, load, inflight=3), ttft_p99_ms=1000)
    assert s is not None
    assert (s.name, s.waiting, s.running, s.kv_usage, s.max_num_seqs) == ("r1", 2, 5, 0.4, 8)
    assert s.predicted_ttft_ms == 400.0 and s.ttft_target_ms == 1000
    assert ReplicaSignals.of(ReplicaState("http://a", "r1", 1, None), 1000) is None


def test_the_spill_window_follows_scale_up_after_s_within_bounds():
    assert replace(LIMITS, scale_up_after_s=1).spill_window_s == 5.0
    assert replace(LIMITS, scale_up_after_s=30).spill_window_s == 30.0
    assert replace(LIMITS, scale_up_after_s=600).spill_window_s == 60.0
    assert replace(LIMITS, max_queue_depth=0).queue_at_risk == 1
    assert au.SPILL_REASONS == ("predicted_ttft", "tpot", "kv_blocks", "queue_depth")
