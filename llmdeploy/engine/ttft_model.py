"""Predicted time to first token of a new prompt under the engine's current queue, from the step-cost model.

It mirrors the scheduler's order (llmdeploy/engine/scheduler.py): decodes run every step; prefill chunks share
the rest of the token budget earliest deadline first (a new prompt's deadline: llmdeploy/policies/deadline.py),
long prompts capped per step. Prompts queued with an earlier deadline go before the new one, whatever their size. The engine publishes the prediction for a ladder of prompt lengths in /load; the router
interpolates it for the request at hand (llmdeploy/policies/overflow.py). Pure: tested without a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmdeploy.policies.deadline import DEFAULT_TTFT_SLA_S, relative_deadline_s
from llmdeploy.policies.step_cost import StepCost, chunk_cost

LADDER = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass(frozen=True)
class PendingPrompt:
    uncomputed: int  # prompt tokens still to prefill
    context: int  # tokens already in the cache (a partial prefill, or a prefix-cache hit)
    long: bool
    slack_s: float | None = None  # its deadline less now (None: as if it arrived now)


@dataclass(frozen=True)
class QueueView:
    pending: tuple[PendingPrompt, ...]  # waiting prompts and partial prefills
    decoding: int  # sequences that take one token every step
    budget: int  # max_num_batched_tokens
    long_threshold: int | None
    long_budget: int  # long prompts' tokens per step while other work is in the engine
    long_budget_alone: int
    free_slots: int  # sequence slots left for new prompts
    slot_wait_s: float  # with no slot left: until the running sequence closest to its end finishes
    step_remaining_s: float = 0.0  # what is left of the step running now
    ttft_sla_s: float = DEFAULT_TTFT_SLA_S  # the deadlines' SLA (policies/deadline.py)


def predicted_ttft_s(q: QueueView, cost: StepCost, prompt_tokens: int) -> float:
    """Conservative seconds until a new prompt of `prompt_tokens` tokens gets its first token."""
    p = max(1, prompt_tokens)
    long = q.long_threshold is not None and p > q.long_threshold
    room = max(1, q.budget - q.decoding)
    per_step = cost.with_prefill_s(q.decoding)
    deadline = relative_deadline_s(cost, p, q.ttft_sla_s)
    slack = [_slack(x, cost, q) for x in q.pending]
    first = [s <= deadline for s in slack]  # an earlier deadline: served before it
    short = [x for x in q.pending if not x.long]
    longs = [x for x in q.pending if x.long]
    if not long:
        ahead = [x for x, f in zip(q.pending, first, strict=True) if f and not x.long]
        tokens = sum(x.uncomputed for x in ahead) + p
        steps = math.ceil(tokens / room)
        # the budget left in those steps goes to the next prompts in order that fit whole
        leftover, riders = steps * room - tokens, []
        behind = [(s, x) for x, f, s in zip(q.pending, first, slack, strict=True) if not f and not x.long]
        for _, x in sorted(behind, key=lambda sx: sx[0]):
            if x.uncomputed > leftover:
                break
            riders.append(x)
            leftover -= x.uncomputed
        effective = sum(_effective(x, cost) for x in ahead + riders) + chunk_cost(
            0, p, cost.attn_cost_context
        )
        # long prompts' chunks: an earlier deadline's go first in every step, later ones ride along where the
        # deadlines leave room (counted as in every step but the last)
        urgent = sum(1 for x, f in zip(q.pending, first, strict=True) if f and x.long)
        riding = min(
            sum(x.uncomputed for x in longs), (steps if urgent else max(0, steps - 1)) * q.long_budget
        )
        seconds = steps * per_step + cost.prefill_token_s * (effective + riding)
        queued_before = len(ahead) + urgent
    else:
        # short prompts go first while their deadlines are earlier, and ride in its steps after that: all counted
        short_tokens = sum(x.uncomputed for x in short)
        ahead = [x for x, f in zip(q.pending, first, strict=True) if f and x.long]
        long_tokens = sum(x.uncomputed for x in ahead) + p
        crowded = q.decoding > 0 or len(q.pending) > len(ahead)
        per_long_step = max(1, q.long_budget if crowded else q.long_budget_alone)
        short_steps = math.ceil(short_tokens / room) if short_tokens else 0
        long_steps = math.ceil(long_tokens / per_long_step)
        context = max((x.context for x in ahead), default=0)
        seconds = (
            (short_steps + long_steps) * per_step
            + cost.prefill_token_s * sum(_effective(x, cost) for x in short)
            # chunking does not change a prompt's total attention cost: sum of n(c + n/2) telescopes
            + cost.prefill_token_s * chunk_cost(context, long_tokens, cost.attn_cost_context)
        )
        queued_before = len(short) + len(ahead)
    if q.free_slots <= queued_before:
        seconds += q.slot_wait_s
    return cost.conservative(q.step_remaining_s + seconds)


def _slack(x: PendingPrompt, cost: StepCost, q: QueueView) -> float:
    if x.slack_s is not None:
        return x.slack_s
    return relative_deadline_s(cost, x.uncomputed + x.context, q.ttft_sla_s)


def _effective(x: PendingPrompt, cost: StepCost) -> float:
    return chunk_cost(x.context, x.uncomputed, cost.attn_cost_context)


def ttft_ladder(q: QueueView, cost: StepCost, max_len: int) -> list[list[float]]:
    """[[prompt tokens, predicted ms], ...] for the ladder's lengths up to max_len (and max_len itself)."""
    lengths = [n for n in LADDER if n < max_len] + [max_len]
    return [[n, round(predicted_ttft_s(q, cost, n) * 1e3, 1)] for n in lengths]


def deadline_ladder(q: QueueView, cost: StepCost, max_len: int) -> list[list[float]]:
    """[[prompt tokens, ms], ...]: the first-token deadline a new prompt of that length gets (its scheduling
    target; the SLA, or scaled where the prompt's own prefill exceeds it)."""
    lengths = [n for n in LADDER if n < max_len] + [max_len]
    return [[n, round(relative_deadline_s(cost, n, q.ttft_sla_s) * 1e3, 1)] for n in lengths]


def ttft_by_class(q: QueueView, cost: StepCost, max_len: int) -> dict[str, dict]:
    """Per class (short: up to the long threshold; long: beyond it), at the class's largest prompt: the predicted
    TTFT under the current queue and the deadline; then the class's pending prompts, how many are already late,
    and the slack of the most urgent one (ms to its deadline, negative when late; None when none waits)."""
    threshold = min(q.long_threshold or max_len, max_len)
    classes = (("short", threshold, False), ("long", max_len, True))
    out: dict[str, dict] = {}
    for name, tokens, is_long in classes[: 1 if threshold >= max_len else 2]:
        slacks = [_slack(x, cost, q) for x in q.pending if x.long == is_long]
        out[name] = {
            "prompt_tokens": tokens,
            "predicted_ttft_ms": round(predicted_ttft_s(q, cost, tokens) * 1e3, 1),
            "deadline_ms": round(relative_deadline_s(cost, tokens, q.ttft_sla_s) * 1e3, 1),
            "pending": len(slacks),
            "late": sum(1 for s in slacks if s < 0),
            "most_urgent_slack_ms": round(min(slacks) * 1e3, 1) if slacks else None,
        }
    return out
