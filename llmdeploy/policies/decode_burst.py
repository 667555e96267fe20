"""How many decode steps one native call runs: a decode burst (LLMEngine.step, ModelRunner.run_burst).

A burst feeds each greedy (or sampled: temperature and min_p alone) token back in C and hands the engine `steps`
tokens a sequence at once, so the Python around a step (scheduling, inputs, sampling, output bookkeeping: ~0.6 ms
of a 6-7 ms batch-1 bf16 step of SmolLM2 on 2 Zen 4 cores, all of it running cold after the weight stream) is paid
once per burst. A prompt that arrives or a request aborted during a burst ends it after the step under way (the
engine's yield flag, read by the C loop between steps), as an ordinary step would make them wait; a stop inside a
burst drops the tokens after it.
Bursts run only where that overhead is a large share of the step (a few sequences) and nobody is waiting. 8 steps
instead of 4 measured even (bf16 batch 1, 10 alternating rounds, Zen 4)."""

from __future__ import annotations

# past a few sequences the Python is a small share of a step (batch 32: 2-4%, bench/step_overhead.py), not worth
# the blocks a burst reserves ahead for every sequence
MAX_SEQS = 4


def burst_allowed(configured: int, decodes: int, waiting: int) -> bool:
    """Whether this decode-only step may burst at all (checked first: it costs nothing): bursts on
    (`configured`, EngineConfig.decode_burst, > 1), 1..MAX_SEQS decoding sequences, no prompt waiting."""
    return configured > 1 and 0 < decodes <= MAX_SEQS and not waiting


def burst_steps(configured: int, room: list[int]) -> int:
    """Steps for an allowed burst whose sequences are all plain greedy or plain sampled: `configured`, capped by
    the tokens each sequence may still produce (`room`: max_tokens left, positions left); 1 is an ordinary step."""
    return max(1, min(configured, *room))
