"""A model-free driver for the scheduler: each step appends a token to every sampled sequence.

Time is virtual: a step takes what the scheduler's step-cost model says it costs, so deadline-driven scheduling is
tested deterministically, and `simulate` replays an arrival schedule (a whole mixed-load run in microseconds)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from llmdeploy.engine.block_manager import BlockManager
from llmdeploy.engine.config import EngineConfig
from llmdeploy.engine.sampling_params import SamplingParams
from llmdeploy.engine.scheduler import ScheduledBatch, Scheduler
from llmdeploy.engine.sequence import Sequence
from llmdeploy.policies.step_cost import chunk_cost


class VirtualClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_scheduler(
    num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, **kw
):
    config = EngineConfig(
        model="sim",  # never loaded: the scheduler reads the batch limits only
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        prefix_caching=kw.pop("prefix_caching", True),
    )
    bm = BlockManager(num_blocks, config.block_size, config.prefix_caching)
    kw.setdefault("clock", VirtualClock())
    return Scheduler(bm, config, **kw)


def seq(n_prompt: int, max_tokens: int = 4, n: int = 1, start: int = 0, rid: str = "") -> Sequence:
    return Sequence(list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, n=n), rid)


def step_seconds(sched: Scheduler, batch: ScheduledBatch) -> float:
    """What the batch costs by the scheduler's own step-cost model (call before postprocess)."""
    attn = sched.attn_cost_context
    prefill = sum(chunk_cost(s.num_computed_tokens, n, attn) for s, n in batch.prefills)
    return sched.cost.step_s(prefill, len(batch.decodes))


def step(sched: Scheduler, rng: random.Random | None = None) -> ScheduledBatch:
    """schedule -> (no forward) -> postprocess -> append a token per sample; finish at max_tokens. A virtual clock
    moves on by the step's modelled time."""
    batch = sched.schedule()
    if isinstance(sched.clock, VirtualClock) and not batch.is_empty:
        sched.clock.t += step_seconds(sched, batch)
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


@dataclass
class Served:
    """One simulated request: when it arrived and got its first token (virtual seconds), and in which step."""

    seq: Sequence
    arrival: float
    first_token: float | None = None
    first_step: int | None = None
    prefill_steps: list[int] = field(default_factory=list)  # steps that carried a chunk of its prompt

    @property
    def ttft(self) -> float:
        assert self.first_token is not None, f"{self.seq} never got a token"
        return self.first_token - self.arrival


def simulate(
    sched: Scheduler, arrivals: list[tuple[float, Sequence]], max_steps: int = 100_000
) -> list[Served]:
    """Replay arrivals (virtual time, sequence) through the scheduler until all finish; idle time jumps to the
    next arrival. Returns one Served per arrival, in arrival order."""
    clock = sched.clock
    assert isinstance(clock, VirtualClock)
    pending = sorted(((t, i, s) for i, (t, s) in enumerate(arrivals)), key=lambda x: (x[0], x[1]))
    served = {s.seq_id: Served(s, t) for t, _, s in pending}
    for n in range(1, max_steps):
        while pending and pending[0][0] <= clock.t:
            t, _, s = pending.pop(0)
            sched.add(s, arrival=t)
        if not sched.has_unfinished():
            if not pending:
                return [served[s.seq_id] for _, s in arrivals]
            clock.t = pending[0][0]
            continue
        batch = step(sched)
        for s, _ in batch.prefills:
            served[s.seq_id].prefill_steps.append(n)
        for s, _ in batch.samples:
            r = served.get(s.seq_id)
            if r is not None and r.first_token is None:
                r.first_token, r.first_step = clock.t, n
    raise AssertionError("simulation did not finish")
