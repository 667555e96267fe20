"""Measured step rates (EWMA) and the queue-wait prediction behind /load (CONTRACTS.md section 4)."""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.2  # weight of the newest step: about the last 10 steps count


def ewma(old: float, new: float) -> float:
    return old + ALPHA * (new - old)


@dataclass
class RateMeter:
    prefill_s_per_token: float  # seconds of step time per prefill token
    decode_step_s: float  # seconds of one decode-only step at the recent batch size
    decode_tokens_per_s: float = 0.0

    def observe(self, num_prefill_tokens: int, num_decodes: int, step_s: float) -> None:
        if num_prefill_tokens:
            # the decode share of a mixed step is about one decode step; the rest is the prefill's
            prefill_s = max(step_s - (self.decode_step_s if num_decodes else 0.0), 0.25 * step_s)
            self.prefill_s_per_token = ewma(self.prefill_s_per_token, prefill_s / num_prefill_tokens)
        elif num_decodes:
            self.decode_step_s = ewma(self.decode_step_s, step_s)
            self.decode_tokens_per_s = ewma(
                self.decode_tokens_per_s or num_decodes / step_s, num_decodes / step_s
            )

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1.0 / self.prefill_s_per_token

    def predicted_wait_s(
        self, pending_prefill_tokens: int, slots_full: bool, min_remaining_tokens: int
    ) -> float:
        """Time until a new request's first token: the prefill work queued before it, plus, when every
        sequence slot is taken, the decode steps until the running sequence closest to its end finishes."""
        wait = pending_prefill_tokens * self.prefill_s_per_token
        if slots_full:
            wait += min_remaining_tokens * self.decode_step_s
        return wait
