"""What a prefill token's attention costs against the rest of its forward, timed on this engine at start.

The scheduler sizes long prompts' chunks, and /load predicts TTFT, by chunk_cost's attention constant
(policies/step_cost.py). It was a figure per dtype measured once on one CPU with one attention kernel; the native
bf16 prefill attention (kernels/csrc/prefill_attention.c) made it wrong by 3x on the machine it came from
(550 -> ~1,600-2,700 tokens on Zen 4). Here the same chunk is timed at context 0 and at a long context, on a scratch
cache, with the model, kernels and threads the engine will serve with.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from llmdeploy.engine.scheduler import ScheduledBatch
from llmdeploy.engine.sequence import Sequence
from llmdeploy.policies.step_cost import attn_cost_context_from

if TYPE_CHECKING:
    from llmdeploy.engine.model_runner import ModelRunner

# one chunk: the fixed part of a step stays small beside it, and the projections run at prefill speed (with 64
# tokens the constant came out ~1,600-2,000 on Zen 4, with 128 and 256 ~2,400-2,700: closer to whole prompts')
PROBE_TOKENS = 128
PROBE_CONTEXT = 1024  # long enough that attention is a measurable share of the step
MIN_PROBE_CONTEXT = 256  # below this (a short max_model_len) the difference is noise: not probed
REPEATS = 2  # the faster of two runs of each step


def probe_context(max_model_len: int) -> int | None:
    """The context the probe times its late chunk at, or None where max_model_len leaves no long one."""
    context = min(PROBE_CONTEXT, max_model_len - PROBE_TOKENS - 1)
    return context if context >= MIN_PROBE_CONTEXT else None


def probe_attn_cost_context(runner: ModelRunner, context: int) -> float | None:
    """chunk_cost's constant measured here with the late chunk at `context` (None: attention not measurably
    dearer there)."""
    seq = Sequence([i % runner.arch.vocab_size for i in range(context + PROBE_TOKENS)])
    blocks = -(-len(seq) // runner.block_size)
    seq.block_table = list(range(blocks))
    scratch = runner.allocate_kv_cache(blocks)  # zeroed: timings over real numbers, not NaNs

    def chunk_s(at: int) -> float:
        seq.num_computed_tokens = at
        batch = ScheduledBatch(prefills=[(seq, PROBE_TOKENS)]).finalize()
        best = math.inf
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            runner.run(batch)
            best = min(best, time.perf_counter() - t0)
        return best

    chunk_s(context)  # the first long-context step pays one-time setup: not used
    fresh, late = chunk_s(0), chunk_s(context)
    del scratch
    return attn_cost_context_from(fresh, late, PROBE_TOKENS, context)
