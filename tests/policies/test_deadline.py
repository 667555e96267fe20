"""Deadlines from a prompt's own prefill and the SLA, and the router's TTFT target built from the same rule."""

from __future__ import annotations

import pytest

from llmdeploy.policies import overflow as ov
from llmdeploy.policies.deadline import (
    STRETCH,
    exceeds_sla,
    own_prefill_s,
    relative_deadline_s,
    ttft_target_s,
)
from llmdeploy.policies.egress import CloudState
from llmdeploy.policies.route import CLOUD, LOCAL, decide
from llmdeploy.policies.snapshot import EngineLoad, ReplicaState, RequestFacts, RevisionState
from llmdeploy.policies.step_cost import StepCost

# the 2-core CPU's figures: a 128-token prompt takes about 0.1 s alone, a 1,500-token one about 1.6 s
CPU = StepCost(fixed_s=0.018, prefill_token_s=0.00062, decode_seq_s=0.0015, attn_cost_context=1000.0)
SLA_S = 1.0


def test_deadline_is_twice_the_own_prefill_capped_by_the_sla():
    short = own_prefill_s(CPU, 128)
    assert short == pytest.approx(0.018 + 0.00062 * 128 * (1 + 64 / 1000))
    assert relative_deadline_s(CPU, 128, SLA_S) == pytest.approx(STRETCH * short)
    mid = 900  # 0.9 s alone: within the SLA, so held to it rather than to twice its own prefill
    assert own_prefill_s(CPU, mid) < SLA_S < STRETCH * own_prefill_s(CPU, mid)
    assert relative_deadline_s(CPU, mid, SLA_S) == SLA_S


def test_a_prompt_whose_own_prefill_exceeds_the_sla_gets_a_scaled_deadline():
    assert exceeds_sla(CPU, 1500, SLA_S)
    alone = own_prefill_s(CPU, 1500)
    assert relative_deadline_s(CPU, 1500, SLA_S) == pytest.approx(STRETCH * alone)
    assert STRETCH * alone > SLA_S
    # the router's target is the SLA wherever the SLA can be met, and that scaled deadline beyond
    assert ttft_target_s(CPU, 128, SLA_S) == SLA_S
    assert ttft_target_s(CPU, 1500, SLA_S) == pytest.approx(STRETCH * alone)
    assert ttft_target_s(None, 1500, SLA_S) == SLA_S  # an engine without a step-cost model


def ladder(scale: float) -> tuple[tuple[float, float], ...]:
    """An engine's predicted TTFT by prompt length: `scale` times the prompt's own prefill (1.25: idle)."""
    return tuple((n, scale * own_prefill_s(CPU, n) * 1e3) for n in (1, 128, 512, 1024, 2048))


def engine(scale: float) -> EngineLoad:
    return EngineLoad(
        free_blocks=1000,
        total_blocks=1024,
        block_size=16,
        max_num_seqs=8,
        ttft_ms_by_prompt_len=ladder(scale),
        step_cost=CPU,
    )


LIMITS = ov.OverflowLimits(ttft_p99_ms=SLA_S * 1e3, max_queue_depth=4)


def reason(load: EngineLoad, prompt: int) -> str | None:
    return ov.overflow_reason(ReplicaState("http://e", "e", 1, load), prompt, 16, LIMITS)


def test_an_idle_engine_keeps_a_long_prompt_that_exceeds_the_sla_alone():
    """Judged against the SLA, every 1,500-token prompt would spill even to an idle engine."""
    assert ov.predicted_ttft_ms(engine(1.25), 1500) > LIMITS.ttft_p99_ms
    assert reason(engine(1.25), 1500) is None
    assert reason(engine(1.25), 128) is None


def test_a_long_prompt_that_would_miss_its_scaled_deadline_spills_and_short_ones_keep_the_sla():
    busy = engine(2.5)  # the queue ahead would take it past twice its own prefill
    assert reason(busy, 1500) == ov.PREDICTED_TTFT
    assert reason(engine(1.9), 1500) is None  # slower than alone, but within its deadline
    slow_short = EngineLoad(
        **{**engine(1.25).__dict__, "ttft_ms_by_prompt_len": ((1, 1200.0), (2048, 1300.0))}
    )
    assert reason(slow_short, 128) == ov.PREDICTED_TTFT  # a short prompt is held to the SLA itself


@pytest.mark.parametrize("egress", [True, False])
def test_the_spilled_long_prompt_goes_to_the_cloud_only_when_its_key_allows_egress(egress):
    revs = [RevisionState(1, "stable", 100, (ReplicaState("http://e", "e", 1, engine(2.5)),))]
    facts = RequestFacts(prompt_tokens=1500, max_tokens=16, key_name="app", key_allows_cloud=egress)
    d = decide(revs, facts, LIMITS, CloudState(enabled=True, breaker_allows=True))
    assert d.overflow_reason == ov.PREDICTED_TTFT
    assert d.action == (CLOUD if egress else LOCAL)  # else served locally, earliest deadline first
