"""A request's TTFT deadline, from its own prefill cost and the SLA: one rule for the engine and the router.

The engine's scheduler serves prefills earliest deadline first (llmdeploy/engine/scheduler.py); the router spills
a request whose predicted TTFT would miss its target (llmdeploy/policies/overflow.py). Both read these functions,
so what the engine promises and what the router checks cannot drift apart.

- A prompt's own prefill (`own_prefill_s`) is one step carrying all of it on an idle engine (step-cost model).
- Its deadline is at most STRETCH times that: earliest-deadline-first over deadlines proportional to each
  request's own cost bounds every request's slowdown (TTFT over TTFT alone) alike, so short prompts overtake long
  ones while they are young, and a long prompt that has waited long enough goes first whatever arrives.
- The SLA caps it for prompts that could meet the SLA alone; a prompt whose own prefill alone exceeds the SLA
  can never meet it, and its deadline is scaled instead: STRETCH times its own prefill.
"""

from __future__ import annotations

from llmdeploy.policies.step_cost import StepCost, chunk_cost

# Deadline over own prefill. The targets (bench/mixed_ttft.py) are 2.5x alone for short prompts and 3x for long
# ones; alone there also pays the chunking, so 2 leaves room for the prediction's error.
STRETCH = 2.0
# A chunk that does not complete its prompt rides in a step that completes prompts only while that step still ends
# within RIDE_STRETCH x each completed prompt's own prefill from its arrival. Riding up to the deadline itself
# (STRETCH) made such steps 1.4-1.9x a short prompt's step alone, on top of the step it had waited for: short p99
# 2.3-3.0x alone at every arrival rate (bench/mixed_ttft.py, Zen 4 bf16, step trace in bench/RESULTS.md).
RIDE_STRETCH = 1.25
DEFAULT_TTFT_SLA_S = 1.0  # = SLASpec.ttft_p99_ms's default, for an engine run without a spec


def own_prefill_s(cost: StepCost, prompt_tokens: int) -> float:
    """Seconds the prompt's prefill takes alone on an idle engine, in one step (no queue, no decodes)."""
    return cost.step_s(chunk_cost(0, max(1, prompt_tokens), cost.attn_cost_context))


def exceeds_sla(cost: StepCost, prompt_tokens: int, ttft_sla_s: float) -> bool:
    """Its own prefill alone misses the SLA: no queue could help it."""
    return own_prefill_s(cost, prompt_tokens) > ttft_sla_s


def relative_deadline_s(cost: StepCost, prompt_tokens: int, ttft_sla_s: float) -> float:
    """Seconds from arrival to the prompt's first-token deadline (what the scheduler orders by)."""
    alone = own_prefill_s(cost, prompt_tokens)
    if alone > ttft_sla_s:
        return STRETCH * alone  # scaled: the SLA is out of its reach
    return min(ttft_sla_s, STRETCH * alone)


def ride_limit_s(cost: StepCost, prompt_tokens: int, ttft_sla_s: float) -> float:
    """Seconds from arrival within which a step that completes this prompt must end for another prompt's partial
    chunk to ride in it (never past the deadline)."""
    return min(
        relative_deadline_s(cost, prompt_tokens, ttft_sla_s),
        RIDE_STRETCH * own_prefill_s(cost, prompt_tokens),
    )


def ttft_target_s(cost: StepCost | None, prompt_tokens: int, ttft_sla_s: float) -> float:
    """What a predicted TTFT is judged against before sending a request to an engine: the SLA, or the scaled
    deadline for a prompt whose own prefill exceeds it (else every such prompt would spill, even to an idle
    engine). Without a step-cost model (an older engine): the SLA."""
    if cost is None or not exceeds_sla(cost, prompt_tokens, ttft_sla_s):
        return ttft_sla_s
    return relative_deadline_s(cost, prompt_tokens, ttft_sla_s)
