"""How many decode steps one native call runs: a decode burst (LLMEngine.step, ModelRunner.run_burst).

A burst feeds each greedy token back in C and hands the engine `steps` tokens a sequence at once, so the Python
around a step (scheduling, inputs, sampling, output bookkeeping: ~0.6 ms of a 6-7 ms batch-1 bf16 step of
SmolLM2 on 2 Zen 4 cores, all of it running cold after the weight stream) is paid once per burst. A prompt that
arrives or a request aborted during a burst ends it after the step under way (the engine's yield flag, read by the
C loop between steps), as an ordinary step would make them wait; a stop inside a burst drops the tokens after it.
Bursts run only where that overhead is a large share of the step (a few sequences) and nobody is waiting. 8 steps
instead of 4 measured even (bf16 batch 1, 10 alternating rounds, Zen 4)."""

from __future__ import annotations

# past a few sequences the Python is a small share of a step (batch 32: 2-4%, bench/step_overhead.py), not worth
# the blocks a burst reserves ahead for every sequence
MAX_SEQS = 4


def burst_steps(configured: int, decodes: int, waiting: int, room: list[int]) -> int:
    """Steps for this decode-only step's native call: 1 (an ordinary step) unless bursts are on (`configured`,
    EngineConfig.decode_burst, > 1), there are 1..MAX_SEQS decoding sequences, all of them plain greedy (the
    caller passes decodes=0 otherwise), and no prompt is waiting; then `configured`, capped by the tokens each
    sequence may still produce (`room`: max_tokens left, positions left)."""
    if configured <= 1 or not 0 < decodes <= MAX_SEQS or waiting:
        return 1
    return max(1, min(configured, *room))
