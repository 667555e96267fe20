"""The engine's step-cost model: what one forward step costs, as a value both the engine and the router use.

A step costs a fixed part (every layer runs, weights are read, the step is prepared and sampled, even for a
3-token prompt), plus a fixed part more when it carries prefill tokens (they run the model's Python layers, where a
decode-only step on CPU is one native call), plus a part per prefill token, plus a part per decoding sequence:

    step_s = fixed_s + prefill_step_s * [prefill tokens > 0] + prefill_token_s * effective_prefill_tokens
             + decode_seq_s * decodes

Charging a whole step to its prefill tokens (the old rate meter) made a short prompt look like a 50 tok/s engine
and sent an idle engine's traffic to the cloud (issue 12). The engine fits these coefficients from its recent
steps (llmdeploy/engine/load_stats.py); predictions from them are pure functions here.

Effective tokens count attention: a prefill token at context c costs about (1 + c / attn_cost_context) fresh
tokens (the scheduler sizes chunks by the same rule), so a long prompt's late chunks are not underestimated.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

MAX_MARGIN = 1.0  # a conservative prediction is at most twice the fitted one


def chunk_cost(context: int, n: int, attn_cost_context: float | None) -> float:
    """A chunk of n tokens after `context` cached ones, in fresh-token equivalents."""
    return n * (1 + (context + n / 2) / attn_cost_context) if attn_cost_context else float(n)


def attn_cost_context_from(fresh_s: float, late_s: float, n: int, context: int) -> float | None:
    """chunk_cost's constant from one chunk of n tokens timed after 0 and after `context` cached tokens: the X
    with late / fresh = chunk_cost(context, n, X) / chunk_cost(0, n, X). None when the late chunk was not
    measurably slower (attention is then cheap against the rest of the step: no weighting)."""
    ratio = late_s / fresh_s if fresh_s > 0 else 0.0
    if ratio <= 1.01:
        return None
    return max(1.0, (context + n / 2 * (1 - ratio)) / (ratio - 1))


@dataclass(frozen=True)
class StepCost:
    fixed_s: float
    prefill_token_s: float
    decode_seq_s: float
    margin: float = 0.0  # relative error of recent predictions (about their p90): the conservative share
    attn_cost_context: float | None = None
    prefill_step_s: float = 0.0  # what a step with prefill tokens costs beyond fixed_s

    def step_s(self, prefill_tokens: float = 0.0, decodes: int = 0) -> float:
        prefill = self.prefill_step_s + self.prefill_token_s * prefill_tokens if prefill_tokens > 0 else 0.0
        return self.fixed_s + prefill + self.decode_seq_s * decodes

    def with_prefill_s(self, decodes: int = 0) -> float:
        """The part of a step carrying prefill tokens that does not grow with them."""
        return self.fixed_s + self.prefill_step_s + self.decode_seq_s * decodes

    def decode_step_s(self, batch: int) -> float:
        """One decode-only step with `batch` sequences: the time per output token each of them sees."""
        return self.step_s(0.0, max(1, batch))

    def prefill_s(self, tokens: int, budget: int, decodes: int = 0, context: int = 0) -> float:
        """Time to prefill `tokens` prompt tokens (after `context` cached ones) in chunks of at most `budget`
        tokens a step, each step also carrying `decodes` running sequences."""
        if tokens <= 0:
            return 0.0
        steps = math.ceil(tokens / max(1, budget))
        return steps * self.with_prefill_s(decodes) + self.prefill_token_s * chunk_cost(
            context, tokens, self.attn_cost_context
        )

    def conservative(self, seconds: float) -> float:
        """What a p99 target is compared with: the prediction plus the fit's recent relative error."""
        return seconds * (1.0 + min(max(self.margin, 0.0), MAX_MARGIN))

    def tokens_within(self, seconds: float, decodes: int = 0) -> int:
        """Most fresh prefill tokens one step can carry and still take at most `seconds` (at least 1)."""
        room = seconds - self.with_prefill_s(decodes)
        return max(1, int(room / self.prefill_token_s)) if self.prefill_token_s > 0 else 1 << 30

    def to_json(self) -> dict[str, Any]:
        return {
            "fixed_ms": round(self.fixed_s * 1e3, 3),
            "prefill_step_ms": round(self.prefill_step_s * 1e3, 3),
            "prefill_token_ms": round(self.prefill_token_s * 1e3, 5),
            "decode_seq_ms": round(self.decode_seq_s * 1e3, 4),
            "margin": round(self.margin, 3),
            "attn_cost_context": None if self.attn_cost_context is None else round(self.attn_cost_context, 1),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> StepCost | None:
        if not isinstance(data, dict):
            return None
        try:
            attn = data.get("attn_cost_context")
            return cls(
                float(data["fixed_ms"]) / 1e3,
                float(data["prefill_token_ms"]) / 1e3,
                float(data["decode_seq_ms"]) / 1e3,
                float(data.get("margin") or 0.0),
                None if attn is None else float(attn),
                prefill_step_s=float(data.get("prefill_step_ms") or 0.0) / 1e3,  # absent from older engines
            )
        except (KeyError, TypeError, ValueError):
            return None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Ceiling:
    batch: int  # concurrent sequences
    output_tokens_per_s: float
    requests_per_s: float


def throughput_ceiling(cost: StepCost, batch: int, prompt_tokens: int, output_tokens: int) -> Ceiling:
    """Steady state with `batch` sequences always running, each request `prompt_tokens` in and `output_tokens` out:
    every step decodes the whole batch and carries the prefill of the requests that replace finished ones
    (batch x prompt / output tokens a step on average, in batch / output of the steps)."""
    batch, out = max(1, batch), max(1, output_tokens)
    prefill_per_step = batch * prompt_tokens / out
    prefill_steps = min(1.0, batch / out) if prompt_tokens > 0 else 0.0
    step = (
        cost.fixed_s
        + cost.decode_seq_s * batch
        + cost.prefill_step_s * prefill_steps
        + cost.prefill_token_s * prefill_per_step
    )
    tokens_per_s = batch / step if step > 0 else 0.0
    return Ceiling(batch, tokens_per_s, tokens_per_s / out)
