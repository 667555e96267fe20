"""Long-prefill limits: which prompts are long, and how much of a step their chunks may take (the step-time bound).

The scheduler (llmdeploy/engine/scheduler.py) applies them; they follow the live step-cost model, so a slower or
busier machine adjusts by itself. Pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmdeploy.policies.step_cost import StepCost

# The step-time bound: a long prompt's chunks may add about this much compute to a step, and a short request that
# arrives meanwhile waits for the rest of that step before its own runs. It is 3/4 of what a typical short prompt's
# prefill adds to a step (128 tokens: 0.08 s on the 2-core CPU) under the live step-cost model, so such a request
# waits at most about 1.75x its own prefill whether the CPU is fast, slow or busy; at least 0.05 s of step, so that
# on a GPU the budget fractions bind instead. The fixed cost every step pays is left out: a small model, or a busy
# machine, can make it most of a step, and a bound on the whole step would shrink long chunks to a token or two.
# Less than 3/4 costs long prompts efficiency (each step pays the fixed cost again); in tests/engine/sim.py at the
# CPU's cost model and one arrival every 0.5 s, 1/2 gave short p99 6x alone, 3/4 2x.
LONG_PREFILL_STEP_S = 0.05
SHORT_PROMPT_TOKENS, SHORT_PROMPT_SHARE = 128, 0.75
LIMITS_HYSTERESIS = 0.1  # the live limits change when the step-cost fit moves them by more than this


@dataclass(frozen=True)
class LongPrefillLimits:
    threshold: int  # more uncomputed prompt tokens than this at admission: a long prompt
    budget: int  # long prompts' chunks of one step together, while other work is in the engine
    budget_alone: int  # the same with nothing else in the engine (a short one may arrive mid-step)


def long_prefill_limits(max_num_batched_tokens: int, in_step: int) -> LongPrefillLimits:
    """Long is over half the step budget, and long chunks get 3/8 of it while others run (bench/mixed_ttft.py,
    budget 256: 1/2 gave short p99 TTFT 2.1-3.5x their TTFT alone, 3/8 1.9-2.5x, 1/4 1.8-2.3x but long prompts'
    TTFT up to 5.4 s instead of 3.5 s) -- each capped by `in_step`, the tokens within the step-time bound, so a
    large budget on a slow device (2048 tokens: 1.6 s a step on the CPU) cannot make a short request wait long."""
    b, in_step = max_num_batched_tokens, max(1, in_step)
    return LongPrefillLimits(
        threshold=max(1, min(b // 2, 2 * in_step)),
        budget=max(1, min(3 * b // 8, in_step)),
        budget_alone=min(b, in_step),
    )


def limits_for_cost(max_num_batched_tokens: int, cost: StepCost) -> LongPrefillLimits:
    """long_prefill_limits at the step-time bound under the step-cost model (see LONG_PREFILL_STEP_S)."""
    short_prefill_s = cost.prefill_token_s * SHORT_PROMPT_TOKENS  # what it adds to a step
    bound_s = max(LONG_PREFILL_STEP_S, cost.with_prefill_s() + SHORT_PROMPT_SHARE * short_prefill_s)
    return long_prefill_limits(max_num_batched_tokens, cost.tokens_within(bound_s))


def moved(old: LongPrefillLimits, new: LongPrefillLimits, by: float = LIMITS_HYSTERESIS) -> bool:
    pairs = ((old.threshold, new.threshold), (old.budget, new.budget), (old.budget_alone, new.budget_alone))
    return any(abs(b - a) > by * max(a, 1) for a, b in pairs)
