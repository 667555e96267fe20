"""The router's SLA rules over engine snapshots (pure): the engine's TTFT ladder, requests the engine has not
seen yet, TPOT at the larger batch, each engine's own prompt-token estimate, and shedding past the wait bound."""

from __future__ import annotations

import pytest

from llmdeploy.policies import overflow as ov
from llmdeploy.policies.egress import CloudState
from llmdeploy.policies.prompt_size import PromptShape, PromptSize
from llmdeploy.policies.route import LOCAL, SHED, decide
from llmdeploy.policies.snapshot import EngineLoad, ReplicaState, RequestFacts, RevisionState
from llmdeploy.policies.step_cost import StepCost

COST = StepCost(fixed_s=0.02, prefill_token_s=0.001, decode_seq_s=0.002, margin=0.0)
LADDER = ((1.0, 21.0), (16.0, 36.0), (256.0, 276.0), (1024.0, 1044.0))
LOAD = EngineLoad(
    free_blocks=1000, total_blocks=1024, max_num_seqs=8, ttft_ms_by_prompt_len=LADDER, step_cost=COST
)
LIMITS = ov.OverflowLimits(ttft_p99_ms=500, max_queue_depth=8, tpot_p99_ms=100, max_wait_ms=2000)


def replica(load: EngineLoad = LOAD, inflight: int = 0) -> ReplicaState:
    return ReplicaState("http://r1", "r1", 1, load, inflight)


def facts(tokens: int, **kw) -> RequestFacts:
    return RequestFacts(prompt_tokens=tokens, max_tokens=16, **kw)


def test_prediction_interpolates_the_engines_ladder_and_extrapolates_past_it():
    assert ov.predicted_ttft_ms(LOAD, 136) == pytest.approx(156.0)
    assert ov.predicted_ttft_ms(LOAD, 2048) == pytest.approx(2068.0)
    assert ov.predicted_ttft_ms(LOAD, 0) == 21.0


def test_requests_the_engine_has_not_counted_yet_are_ahead_of_this_one():
    # 3 in flight from this router, none in the engine's last /load: as if 4 prompts of this size were queued
    assert ov.predicted_ttft_ms(LOAD, 100, inflight=3) == pytest.approx(ov.predicted_ttft_ms(LOAD, 400))


def test_without_a_ladder_the_old_rule_applies():
    old = EngineLoad(predicted_queue_wait_ms=100.0, prefill_tokens_per_s=1000.0)
    assert ov.predicted_ttft_ms(old, 500) == pytest.approx(600.0)


def test_tpot_is_one_decode_step_at_the_larger_batch_capped_by_the_slots():
    busy = EngineLoad(**{**LOAD.__dict__, "decoding": 5, "waiting": 1})
    assert ov.predicted_tpot_ms(busy) == pytest.approx((0.02 + 0.002 * 7) * 1e3)
    full = EngineLoad(**{**LOAD.__dict__, "decoding": 50})
    assert ov.predicted_tpot_ms(full) == pytest.approx((0.02 + 0.002 * 8) * 1e3)
    assert ov.predicted_tpot_ms(EngineLoad()) is None


def test_tpot_overflow_reason():
    tight = ov.OverflowLimits(ttft_p99_ms=500, max_queue_depth=8, tpot_p99_ms=30)
    busy = EngineLoad(**{**LOAD.__dict__, "decoding": 5})
    assert ov.overflow_reason(replica(busy), 10, 16, tight) == ov.TPOT
    assert ov.overflow_reason(replica(LOAD), 10, 16, tight) is None  # alone it meets 30 ms


def test_each_engine_turns_the_prompt_shape_into_its_own_tokens():
    chatty = EngineLoad(**{**LOAD.__dict__, "prompt_size": PromptSize(0.25, 5.0, 25.0, 1.0)})
    shape = PromptShape(text_bytes=400, messages=2)
    f = facts(tokens=102, prompt=shape)
    assert ov.prompt_tokens_on(replica(chatty), f) == 100 + 10 + 25
    assert ov.prompt_tokens_on(replica(LOAD), f) == 102  # no coefficients: the router's own guess


def test_a_request_that_may_not_spill_is_shed_past_the_wait_bound():
    queued = EngineLoad(**{**LOAD.__dict__, "ttft_ms_by_prompt_len": ((1.0, 3000.0), (1024.0, 4000.0))})
    cloud_off = CloudState(enabled=False, breaker_allows=True)
    revs = [RevisionState(1, "stable", 100, (replica(queued),))]
    d = decide(revs, facts(10), LIMITS, cloud_off)
    assert d.action == SHED and d.retry_after_s == pytest.approx(
        1.0088, rel=1e-3
    )  # until 2 s of wait are left
    patient = ov.OverflowLimits(ttft_p99_ms=500, max_queue_depth=8, max_wait_ms=10_000)
    assert (
        decide(revs, facts(10), patient, cloud_off).action == LOCAL
    )  # slower than the SLA, within the bound
