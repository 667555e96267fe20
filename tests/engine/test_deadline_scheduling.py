"""Deadline-aware scheduling without a model: earliest deadline first, limits that follow the live step-cost
model, a whole mixed-load run in virtual time (tests/engine/sim.py), and the TTFT prediction that mirrors it."""

from __future__ import annotations

import random

import pytest

from llmdeploy.engine.prefill_limits import limits_for_cost
from llmdeploy.engine.sampling_params import SamplingParams
from llmdeploy.engine.sequence import Sequence, SequenceStatus
from llmdeploy.engine.ttft_model import PendingPrompt, QueueView, predicted_ttft_s
from llmdeploy.policies.deadline import relative_deadline_s
from llmdeploy.policies.step_cost import StepCost
from tests.engine.sim import make_scheduler, simulate, step

# the 2-core CPU's step-cost model (SmolLM2-135M, float32), a 4x slower one, and a GPU's
CPU = StepCost(fixed_s=0.018, prefill_token_s=0.00062, decode_seq_s=0.0015, attn_cost_context=1000.0)
GPU = StepCost(fixed_s=0.012, prefill_token_s=0.00001, decode_seq_s=0.0001)
LONG_AT, SHORT, LONG = (2, 9, 16, 23), 128, 1500


def engine_like(cost: StepCost, **kw):
    kw = dict(num_blocks=4096, block_size=16, max_num_seqs=64, max_num_batched_tokens=2048, **kw)
    return make_scheduler(max_model_len=2048, attn_cost_context=cost.attn_cost_context, cost=cost, **kw)


def request(i: int, n: int, max_tokens: int = 32) -> Sequence:
    return Sequence(
        [(i * 7919 + k) % 30000 for k in range(n)], SamplingParams(max_tokens=max_tokens), f"r{i}"
    )


def mixed_run(cost: StepCost, interval: float):
    """bench/mixed_ttft.py's workload in virtual time: 32 requests, 4 long; TTFT over TTFT alone by class."""
    alone_short = simulate(engine_like(cost), [(0.0, request(900, SHORT))])[0].ttft
    alone_long = simulate(engine_like(cost), [(0.0, request(901, LONG))])[0].ttft
    arrivals = [(i * interval, request(i, LONG if i in LONG_AT else SHORT)) for i in range(32)]
    served = simulate(engine_like(cost), arrivals)
    shorts = [r.ttft / alone_short for i, r in enumerate(served) if i not in LONG_AT]
    longs = [r.ttft / alone_long for i, r in enumerate(served) if i in LONG_AT]
    return shorts, longs, served


@pytest.mark.parametrize("interval", [0.5, 1.0])
def test_mixed_load_bounds_both_classes_in_virtual_time(interval):
    """The issue's targets, in the scheduler's own time model: short <= 2.5x alone, long <= 3x alone."""
    shorts, longs, _ = mixed_run(CPU, interval)
    assert max(shorts) <= 2.5 and max(longs) <= 3.0


def test_an_overloaded_engine_lets_neither_class_starve():
    """Arrivals faster than the engine computes (one every 0.25 s): some are late, but both classes stay bounded
    (under shortest-first, long prompts waited for the whole stream of short ones)."""
    shorts, longs, _ = mixed_run(CPU, 0.25)
    assert max(shorts) <= 3.0 and max(longs) <= 4.0


def test_the_head_of_every_prefill_batch_has_the_earliest_deadline():
    rng = random.Random(7)
    sched = engine_like(CPU)
    t, arrivals = 0.0, []
    for i in range(60):
        t += rng.expovariate(4.0)
        arrivals.append((t, request(i, rng.choice([16, 64, 128, 128, 600, 1500]), rng.randint(1, 24))))
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= sched.clock.t:
            sched.add(pending[0][1], arrival=pending.pop(0)[0])
        if not sched.has_unfinished():
            sched.clock.t = pending[0][0]
            continue
        due = {s.seq_id: sched.deadline(s) for s in sched.waiting + sched.running if s.num_uncomputed > 1}
        batch = step(sched)
        if batch.prefills:
            assert due[batch.prefills[0][0].seq_id] == min(due.values())
    assert all(s.is_finished for _, s in arrivals)


def test_a_long_prompt_meets_its_deadline_under_a_stream_of_short_ones():
    """Short prompts arrive back to back, one every 0.3 s (a third of the engine): the long one meets its scaled
    deadline, and every short one meets its own."""
    arrivals = [(0.0, request(0, LONG))] + [(0.01 + 0.3 * i, request(i + 1, SHORT, 4)) for i in range(30)]
    sched = engine_like(CPU)
    served = simulate(sched, arrivals)
    assert served[0].ttft <= relative_deadline_s(CPU, LONG, sched.ttft_sla_s)
    assert max(r.ttft for r in served[1:]) <= relative_deadline_s(CPU, SHORT, sched.ttft_sla_s) + 1e-9
    assert len(served[0].prefill_steps) > 1  # chunked, between the short ones


def test_limits_follow_the_live_step_cost_model():
    """A device whose step-time floor (0.05 s) buys 200 tokens, then gets busier: long chunks shrink with it;
    jitter within 10% changes nothing; on the CPU a chunk is 3/4 of a short prompt; on a GPU the fractions bind."""
    fast = StepCost(fixed_s=0.01, prefill_token_s=0.0002, decode_seq_s=0.0005)
    sched = engine_like(fast)
    assert sched.limits == limits_for_cost(2048, fast) and sched.limits.budget == 200
    jitter = StepCost(fast.fixed_s * 1.03, fast.prefill_token_s * 0.98, fast.decode_seq_s, 0.1)
    assert not sched.set_cost(jitter) and sched.limits.budget == 200
    assert sched.cost is jitter  # deadlines and the room in a step use the newest fit at once
    busy = StepCost(fast.fixed_s, fast.prefill_token_s * 1.5, fast.decode_seq_s, 0.1)
    assert sched.set_cost(busy) and sched.limits == limits_for_cost(2048, busy)
    assert sched.limits.budget == 133 and sched.limits.threshold == 266
    assert sched.set_cost(CPU) and sched.limits.budget == 96  # 3/4 of 128 tokens
    assert sched.set_cost(GPU) and sched.limits.budget == 2048 * 3 // 8
    fixed = make_scheduler(long_prefill_threshold=32, long_prefill_budget=24, cost=CPU)
    assert not fixed.set_cost(GPU) and fixed.long_prefill_threshold == 32  # explicit limits stay


def test_limits_keep_the_same_token_share_on_a_slower_or_busier_cpu():
    slow = StepCost(4 * CPU.fixed_s, 4 * CPU.prefill_token_s, 4 * CPU.decode_seq_s, 0.0, 1000.0)
    busy = StepCost(25 * CPU.fixed_s, CPU.prefill_token_s, CPU.decode_seq_s, 0.0, 1000.0)  # fixed cost 0.45 s
    assert limits_for_cost(2048, slow) == limits_for_cost(2048, busy) == limits_for_cost(2048, CPU)


def test_preempted_and_forked_sequences_keep_a_deadline():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_model_len=24)
    sched.watermark_blocks = 0
    a, b, c = (request(i, 8, 6) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    due = sched.deadline(c)
    step(sched)
    step(sched)  # c preempted: it keeps its deadline and goes first
    assert c.status is SequenceStatus.WAITING and sched.deadline(c) == due
    assert sched._prefill_order()[0] is c
    forked = make_scheduler(num_blocks=32)
    parent = Sequence(list(range(6)), SamplingParams(max_tokens=3, n=2))
    forked.add(parent)
    ((_, child),) = forked.schedule().forks
    assert forked.deadline(child) == forked.deadline(parent)
    forked.finish(parent, "abort")
    assert parent.seq_id not in forked.deadlines


def queue(*pending: PendingPrompt) -> QueueView:
    return QueueView(pending, 2, 2048, 256, 128, 128, 64, slot_wait_s=1.0, ttft_sla_s=1.0)


def test_prediction_puts_an_urgent_long_prompt_ahead_and_a_young_one_behind():
    """It mirrors the order: a long prompt due sooner than a new short prompt takes its chunk first in every step;
    one due later only rides along."""
    young = PendingPrompt(1200, 300, True, slack_s=5.0)  # due after a new long prompt too
    urgent = PendingPrompt(1200, 300, True, slack_s=0.05)
    alone = predicted_ttft_s(queue(), CPU, SHORT)
    assert predicted_ttft_s(queue(young), CPU, SHORT) == pytest.approx(alone)
    assert predicted_ttft_s(queue(urgent), CPU, SHORT) == pytest.approx(alone + CPU.prefill_token_s * 128)
    # a new long prompt waits for the urgent one, not for the young one's whole prompt
    assert predicted_ttft_s(queue(urgent), CPU, LONG) > predicted_ttft_s(queue(young), CPU, LONG)
