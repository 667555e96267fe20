"""A model-free driver for the scheduler: each step appends a token to every sampled sequence."""

from __future__ import annotations

import random

from llmdeploy.engine.block_manager import BlockManager
from llmdeploy.engine.sampling_params import SamplingParams
from llmdeploy.engine.scheduler import ScheduledBatch, Scheduler
from llmdeploy.engine.sequence import Sequence


def make_scheduler(
    num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, **kw
):
    bm = BlockManager(num_blocks, block_size, kw.pop("prefix_caching", True))
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len, **kw)


def seq(n_prompt: int, max_tokens: int = 4, n: int = 1, start: int = 0, rid: str = "") -> Sequence:
    return Sequence(list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, n=n), rid)


def step(sched: Scheduler, rng: random.Random | None = None) -> ScheduledBatch:
    """schedule -> (no forward) -> postprocess -> append a token per sample; finish at max_tokens."""
    batch = sched.schedule()
    sched.postprocess(batch)
    for s, _ in batch.samples:
        if s.is_finished:
            continue
        s.append(rng.randrange(50) if rng else 7)
        if s.num_output_tokens >= s.params.max_tokens:
            sched.finish(s, "length")
    return batch


def run_all(sched: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.has_unfinished():
        step(sched)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps
