"""Every routing decision as a pure function over plain snapshot data."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmdeploy.policies import overflow as ov
from llmdeploy.policies.breaker import CLOSED, HALF_OPEN, OPEN, BreakerConfig, CircuitBreaker
from llmdeploy.policies.egress import CloudState, cloud_denied_reason, header_allows_cloud
from llmdeploy.policies.ratelimit import KeyRateLimiter, TokenBucket, burst_bucket
from llmdeploy.policies.route import CLOUD, LOCAL, REJECT, WAIT, decide
from llmdeploy.policies.snapshot import EngineLoad, ReplicaState, RequestFacts, RevisionState
from llmdeploy.policies.split import choose_revision, parse_pinned, sticky_bucket

IDLE = EngineLoad(
    waiting=0,
    running=0,
    free_blocks=1000,
    total_blocks=1024,
    block_size=16,
    prefill_tokens_per_s=1000.0,
    predicted_queue_wait_ms=0.0,
    max_num_seqs=8,
)
LIMITS = ov.OverflowLimits(ttft_p99_ms=1000, max_queue_depth=4, use_predicted_ttft=True)
CLOUD_UP = CloudState(enabled=True, breaker_allows=True)
CLOUD_OFF = CloudState(enabled=False, breaker_allows=True)


def replica(name="r1", rev=1, load=IDLE, inflight=0, **kw) -> ReplicaState:
    return ReplicaState(url=f"http://{name}", replica=name, revision=rev, load=load, inflight=inflight, **kw)


def revs(*replicas, rev=1) -> list[RevisionState]:
    return [RevisionState(rev, "stable", 100, tuple(replicas))]


def facts(prompt=10, max_tokens=16, **kw) -> RequestFacts:
    return RequestFacts(prompt_tokens=prompt, max_tokens=max_tokens, key_name="app", **kw)


# ---- overflow rules -------------------------------------------------------------------------------------


def test_idle_replica_takes_request():
    assert ov.overflow_reason(replica(), 100, 16, LIMITS) is None


def test_predicted_ttft_counts_queue_wait_and_prefill():
    load = EngineLoad(**{**IDLE.__dict__, "predicted_queue_wait_ms": 600.0, "prefill_tokens_per_s": 1000.0})
    assert ov.predicted_ttft_ms(load, 300) == pytest.approx(900.0)
    assert ov.overflow_reason(replica(load=load), 300, 16, LIMITS) is None
    assert ov.overflow_reason(replica(load=load), 500, 16, LIMITS) == ov.PREDICTED_TTFT


def test_predicted_ttft_rule_can_be_switched_off():
    load = EngineLoad(**{**IDLE.__dict__, "predicted_queue_wait_ms": 5000.0})
    off = ov.OverflowLimits(1000, 4, use_predicted_ttft=False)
    assert ov.overflow_reason(replica(load=load), 10, 16, off) is None


def test_free_blocks_must_hold_prompt_plus_max_tokens():
    load = EngineLoad(**{**IDLE.__dict__, "free_blocks": 4, "block_size": 16})  # 64 tokens of room
    assert ov.overflow_reason(replica(load=load), 40, 24, LIMITS) is None
    assert ov.overflow_reason(replica(load=load), 40, 25, LIMITS) == ov.KV_BLOCKS


def test_queue_depth_from_engine_and_from_router_inflight():
    deep = EngineLoad(**{**IDLE.__dict__, "waiting": 4, "running": 8})
    assert ov.overflow_reason(replica(load=deep), 10, 16, LIMITS) == ov.QUEUE_DEPTH
    # the /load poll says idle, but the router already has 12 in flight on an 8-seq engine: 4 wait
    assert ov.overflow_reason(replica(inflight=12), 10, 16, LIMITS) == ov.QUEUE_DEPTH
    assert ov.overflow_reason(replica(inflight=11), 10, 16, LIMITS) is None


def test_zero_queue_depth_overflows_once_the_batch_is_full():
    zero = ov.OverflowLimits(1000, 0)
    assert ov.overflow_reason(replica(inflight=7), 10, 16, zero) is None
    assert ov.overflow_reason(replica(inflight=8), 10, 16, zero) == ov.QUEUE_DEPTH


def test_unreachable_or_unready_or_broken_replica_is_down():
    assert ov.overflow_reason(replica(load=None), 1, 1, LIMITS) == ov.LOCAL_DOWN
    assert ov.overflow_reason(replica(load=EngineLoad(ready=False)), 1, 1, LIMITS) == ov.LOCAL_DOWN
    assert ov.overflow_reason(replica(breaker_allows=False), 1, 1, LIMITS) == ov.LOCAL_DOWN
    assert ov.overflow_reason(replica(listed_ready=False), 1, 1, LIMITS) == ov.LOCAL_DOWN


def test_least_loaded_orders_usable_replicas():
    busy = EngineLoad(**{**IDLE.__dict__, "running": 5})
    a, b, c = replica("a", load=busy), replica("b", inflight=2), replica("c", load=None)
    assert [r.replica for r in ov.least_loaded([a, b, c])] == ["b", "a"]


def test_engine_load_from_json_ignores_unknown_and_missing():
    load = EngineLoad.from_json(
        {"waiting": "3", "running": 1, "kv_usage": 0.5, "new_field": 1, "ready": False}
    )
    assert (load.waiting, load.running, load.kv_usage, load.ready, load.free_blocks) == (3, 1, 0.5, False, 0)


# ---- the whole decision -----------------------------------------------------------------------------------


def test_local_first_with_cloud_as_failover():
    d = decide(revs(replica()), facts(), LIMITS, CLOUD_UP)
    assert d.action == LOCAL and [t.backend for t in d.plan] == ["local", "cloud"]


def test_overflow_goes_to_cloud_with_reason_and_local_fallback():
    d = decide(revs(replica(inflight=12)), facts(), LIMITS, CLOUD_UP)
    assert (d.action, d.overflow_reason) == (CLOUD, ov.QUEUE_DEPTH)
    assert [t.backend for t in d.plan] == ["cloud", "local"]


def test_second_replica_used_when_first_cannot_fit():
    small = EngineLoad(**{**IDLE.__dict__, "free_blocks": 1})
    a, b = replica("a", load=small), replica("b", inflight=3)
    d = decide(revs(a, b), facts(prompt=100), LIMITS, CLOUD_UP)
    assert d.action == LOCAL and d.plan[0].replica.replica == "b"


def test_burst_overflows_only_when_cloud_allowed():
    d = decide(revs(replica()), facts(), LIMITS, CLOUD_UP, take_burst_token=lambda: False)
    assert (d.action, d.overflow_reason) == (CLOUD, ov.BURST)
    d = decide(revs(replica()), facts(), LIMITS, CLOUD_OFF, take_burst_token=lambda: False)
    assert d.action == LOCAL


@pytest.mark.parametrize("kw", [{"key_allows_cloud": False}, {"header_allows_cloud": False}])
def test_egress_denied_never_plans_the_cloud(kw):
    for r in (replica(inflight=12), replica(load=None), replica()):
        d = decide(revs(r), facts(**kw), LIMITS, CLOUD_UP, take_burst_token=lambda: False)
        assert all(t.backend != CLOUD for t in d.plan)
        assert d.egress_denied in ("key_no_egress", "request_no_egress")


def test_no_cloud_deep_queue_waits_soft_limits_stay_local():
    assert decide(revs(replica(inflight=12)), facts(), LIMITS, CLOUD_OFF).action == WAIT
    assert decide(revs(replica(load=None)), facts(), LIMITS, CLOUD_OFF).action == WAIT
    slow = EngineLoad(**{**IDLE.__dict__, "predicted_queue_wait_ms": 9000.0})
    d = decide(revs(replica(load=slow)), facts(), LIMITS, CLOUD_OFF)
    assert (d.action, d.overflow_reason) == (LOCAL, ov.PREDICTED_TTFT)


def test_cloud_breaker_open_means_no_cloud():
    d = decide(revs(replica(inflight=12)), facts(), LIMITS, CloudState(True, breaker_allows=False))
    assert (d.action, d.egress_denied) == (WAIT, "cloud_breaker_open")


def test_pinned_revision_rules():
    stable = RevisionState(1, "stable", 100, (replica("s", rev=1),))
    cand = RevisionState(2, "candidate", 0, (replica("c", rev=2),))
    down = RevisionState(3, "candidate", 0, (replica("d", rev=3, load=None),))
    d = decide([stable, cand], facts(pinned_revision=2), LIMITS, CLOUD_UP)
    assert d.action == LOCAL and d.revision == 2 and all(t.backend == LOCAL for t in d.plan)
    assert decide([stable, cand], facts(pinned_revision=9), LIMITS, CLOUD_UP).status == 404
    d = decide([stable, down], facts(pinned_revision=3), LIMITS, CLOUD_UP)
    assert (d.action, d.status, d.code) == (REJECT, 400, "revision_not_ready")


def test_parse_pinned():
    assert parse_pinned(None) is None and parse_pinned(" 3 ") == 3
    with pytest.raises(ValueError):
        parse_pinned("three")
    with pytest.raises(ValueError):
        parse_pinned("-1")


# ---- sticky canary split ----------------------------------------------------------------------------------


def two_revisions(percent: float) -> list[RevisionState]:
    return [
        RevisionState(1, "stable", 100 - percent, (replica("s", rev=1),)),
        RevisionState(2, "candidate", percent, (replica("c", rev=2),)),
    ]


@given(st.text(min_size=1, max_size=40))
def test_bucket_in_range_and_deterministic(value):
    b = sticky_bucket(value)
    assert 0 <= b < 100 and b == sticky_bucket(value)


@given(st.text(min_size=1, max_size=40), st.floats(0, 100), st.floats(0, 100))
def test_raising_percent_only_moves_stable_to_candidate(session, p1, p2):
    low, high = sorted((p1, p2))
    at_low = choose_revision(two_revisions(low), session).revision.revision
    at_high = choose_revision(two_revisions(high), session).revision.revision
    assert not (at_low == 2 and at_high == 1)


def test_split_share_is_close_to_percent():
    sessions = [f"session-{i}" for i in range(4000)]
    share = sum(choose_revision(two_revisions(10), s).revision.revision == 2 for s in sessions) / len(
        sessions
    )
    assert 0.08 < share < 0.12


def test_unready_candidate_gets_nothing():
    revisions = [
        RevisionState(1, "stable", 50, (replica("s", rev=1),)),
        RevisionState(2, "candidate", 50, (replica("c", rev=2, load=None),)),
    ]
    assert all(choose_revision(revisions, f"s{i}").revision.revision == 1 for i in range(200))


# ---- egress -----------------------------------------------------------------------------------------------


def test_egress_header_only_restricts():
    assert header_allows_cloud(None) and header_allows_cloud("true") and header_allows_cloud("yes")
    assert (
        not header_allows_cloud("false")
        and not header_allows_cloud(" FALSE ")
        and not header_allows_cloud("0")
    )
    assert cloud_denied_reason(False, True, CLOUD_UP) == "key_no_egress"
    assert cloud_denied_reason(True, True, CLOUD_OFF) == "cloud_disabled"
    assert cloud_denied_reason(True, True, CLOUD_UP) is None


# ---- rate limits ------------------------------------------------------------------------------------------


def test_token_bucket_refills_at_rate():
    b = TokenBucket(rate_per_s=2, capacity=2)
    assert b.try_take(0) and b.try_take(0) and not b.try_take(0)
    assert b.retry_after(0) == pytest.approx(0.5)
    assert not b.try_take(0.4) and b.try_take(0.5)


def test_burst_bucket_allows_one_second_of_burst():
    b = burst_bucket(5)
    assert sum(b.try_take(10.0) for _ in range(10)) == 5


def test_key_rpm_limit_and_hot_reload():
    rl = KeyRateLimiter()
    rl.configure({"app": 2, "free": None})
    assert rl.check("app", 0) is None and rl.check("app", 0) is None
    wait = rl.check("app", 0)
    assert wait == pytest.approx(30.0)
    assert all(rl.check("free", 0) is None for _ in range(100))
    rl.configure({"app": 60, "free": None})  # reload keeps the spent state, with the new rate
    assert rl.check("app", 1.0) is None
    rl.configure({})
    assert rl.check("app", 1.0) is None


# ---- circuit breaker --------------------------------------------------------------------------------------


def test_breaker_opens_on_consecutive_failures_and_recovers_through_one_probe():
    br = CircuitBreaker(BreakerConfig(consecutive_failures=3, error_rate=1.0, window_s=30, cooldown_s=10))
    for t in range(2):
        br.record(False, t)
    assert br.state == CLOSED
    br.record(False, 2)
    assert br.state == OPEN and not br.allows(5) and not br.acquire(5)
    assert br.allows(12)
    assert br.acquire(12) and br.state == HALF_OPEN
    assert not br.acquire(12)  # a single probe at a time
    br.record(True, 13)
    assert br.state == CLOSED and br.acquire(13)


def test_breaker_reopens_when_probe_fails():
    br = CircuitBreaker(BreakerConfig(consecutive_failures=1, cooldown_s=5))
    br.record(False, 0)
    assert br.acquire(6)
    br.record(False, 6)
    assert br.state == OPEN and not br.allows(10) and br.allows(11)


def test_breaker_opens_on_error_rate_in_window():
    br = CircuitBreaker(BreakerConfig(consecutive_failures=100, error_rate=0.5, window_s=30, cooldown_s=5))
    for i in range(10):
        br.record(i % 2 == 0, i)  # alternating: never 2 failures in a row, 50% failed
    assert br.state == OPEN


def test_breaker_window_forgets_old_failures():
    br = CircuitBreaker(BreakerConfig(consecutive_failures=100, error_rate=0.5, window_s=5, cooldown_s=5))
    for i in range(6):
        br.record(False, 0.1 * i)
    for i in range(10):
        br.record(True, 100 + i)
    assert br.state == CLOSED


def test_decode_bursts_only_for_a_few_plain_greedy_sequences_with_nobody_waiting():
    from llmdeploy.policies.decode_burst import MAX_SEQS, burst_allowed, burst_steps

    assert burst_allowed(4, 1, 0) and burst_steps(4, [100]) == 4
    assert burst_steps(4, [100, 3]) == 3  # capped by the tokens a sequence may still produce
    assert burst_steps(4, [0]) == 1
    assert not burst_allowed(1, 1, 0)  # off
    assert not burst_allowed(4, 1, 1)  # a prompt is waiting: it must not wait for a burst
    assert not burst_allowed(4, 0, 0)  # nothing decoding
    assert burst_allowed(4, MAX_SEQS, 0) and burst_steps(4, [9] * MAX_SEQS) == 4
    assert not burst_allowed(4, MAX_SEQS + 1, 0)
