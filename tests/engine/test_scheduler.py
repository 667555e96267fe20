from __future__ import annotations

import pytest

from llmdeploy.engine.errors import CapacityError, ContextLengthError
from llmdeploy.engine.prefill_limits import LongPrefillLimits, long_prefill_limits
from llmdeploy.engine.scheduler import chunk_cost, chunk_within_cost
from llmdeploy.engine.sequence import SequenceStatus
from tests.engine.sim import make_scheduler, run_all, seq, step, step_seconds


def test_decodes_first_then_prefill_gets_the_rest_of_the_budget():
    sched = make_scheduler(max_num_batched_tokens=10)
    running = [seq(3, max_tokens=20, start=i * 10) for i in range(3)]
    for s in running:
        sched.add(s)
    step(sched)  # 9 prompt tokens, one step
    assert all(s.num_uncomputed == 1 for s in running)
    long = seq(50, start=500)
    sched.add(long)
    batch = step(sched)
    assert batch.decodes == running
    assert batch.prefills == [(long, 7)]
    assert batch.num_tokens == 10


def test_long_prompt_is_chunked_and_running_decodes_never_stall():
    sched = make_scheduler(max_num_batched_tokens=16, num_blocks=64)
    short = seq(4, max_tokens=30)
    sched.add(short)
    step(sched)
    long = seq(100, start=1000)
    sched.add(long)
    chunks = []
    while long.num_uncomputed > 1 or not long.output_token_ids:
        n_out = short.num_output_tokens
        batch = step(sched)
        assert short.num_output_tokens == n_out + 1  # a token every step while the long prompt prefills
        assert batch.num_tokens <= 16
        chunks += [n for s, n in batch.prefills if s is long]
    assert sum(chunks) == 100 and max(chunks) <= 15


def test_several_partial_prefills_share_a_step():
    sched = make_scheduler(max_num_batched_tokens=32)
    a, b = seq(10), seq(12, start=100)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [(s, n) for s, n in batch.prefills] == [(a, 10), (b, 12)]


def test_a_short_prompt_overtakes_a_long_one_that_arrived_earlier():
    """Earliest deadline first (1 ms a token here): 5 tokens are due 10 ms after arrival, 200 tokens 400 ms after."""
    sched = make_scheduler(max_num_batched_tokens=16, num_blocks=128)
    long = seq(200)
    sched.add(long)
    step(sched)
    short = seq(5, start=1000)
    sched.add(short)
    assert sched.deadline(short) < sched.deadline(long)
    batch = sched.schedule()
    assert batch.prefills[0] == (
        short,
        5,
    )  # ahead of the long one's next chunk, which rides within its deadline
    assert sched.clock() + step_seconds(sched, batch) <= sched.deadline(short) + 1e-9


def test_aging_bounds_how_long_a_long_prompt_waits():
    aging = 6
    sched = make_scheduler(max_num_batched_tokens=8, num_blocks=512, max_num_seqs=64, aging_steps=aging)
    long = seq(40, max_tokens=1, start=5000)
    sched.add(long)
    got = []
    for i in range(40):  # two fresh 4-token prompts arrive every step: shorts alone would fill the budget
        sched.add(seq(4, max_tokens=1, start=i * 100))
        sched.add(seq(4, max_tokens=1, start=i * 100 + 50))
        batch = step(sched)
        got.append(sum(n for s, n in batch.prefills if s is long))
    served = [i for i, n in enumerate(got) if n]
    assert served[0] == aging  # starved for `aging` steps, then first
    gaps = [b - a for a, b in zip(served, served[1:], strict=False)]
    assert max(gaps) <= aging + 1  # and a chunk at least that often
    assert all(got[i] == 8 for i in served[:-1])  # aged: it goes first and gets the whole budget
    assert long.is_finished


def test_a_partial_chunk_joins_a_step_that_completes_a_prompt_only_within_its_ride_limit():
    sched = make_scheduler(max_num_batched_tokens=32, num_blocks=128)
    other = seq(4, max_tokens=50, start=900)
    sched.add(other)
    step(sched)
    long = seq(100)
    sched.add(long)
    batch = step(sched)
    assert batch.decodes == [other] and batch.prefills == [(long, 31)]
    late = seq(6, start=500)
    sched.add(late, arrival=sched.clock() - 1.0)  # already past its deadline
    assert step(sched).prefills == [(late, 6)]  # the late prompt's step carries nothing else
    fresh = seq(6, start=700)
    sched.add(fresh)  # due 12 ms from now at 1 ms a token, but others ride only within 1.25 x its 6 ms
    assert step(sched).prefills == [(fresh, 6), (long, 1)]
    assert step(sched).prefills == [(long, 29)]  # three decodes now


def test_a_long_prompt_whose_deadline_comes_first_goes_first():
    """No starvation: once a long prompt's deadline is the earliest, it goes first whatever arrives."""
    sched = make_scheduler(max_num_batched_tokens=32, num_blocks=128)
    other = seq(4, max_tokens=50, start=900)
    sched.add(other)
    step(sched)
    long = seq(100)
    sched.add(long)
    assert step(sched).prefills == [(long, 31)]
    sched.clock.t = sched.deadline(long) - 0.005  # a 6-token prompt arriving now is due in 12 ms: after it
    short = seq(6, start=700)
    sched.add(short)
    assert step(sched).prefills == [(long, 31)]  # first, and its chunk takes the whole token budget
    assert short.num_output_tokens == 0


def test_chunk_within_cost():
    for ctx in (0, 100, 1000, 5000):
        n = chunk_within_cost(ctx, 256, 512.0)
        assert n * (1 + (ctx + n / 2) / 512) <= 256 < (n + 1) * (1 + (ctx + (n + 1) / 2) / 512)
    assert chunk_within_cost(10**6, 16, 512.0) == 1


def test_continuing_chunks_shrink_with_context_while_others_wait():
    sched = make_scheduler(
        max_num_batched_tokens=64, num_blocks=512, max_model_len=2048, attn_cost_context=64.0
    )
    other = seq(4, max_tokens=200, start=9000)
    sched.add(other)
    step(sched)
    long = seq(600)
    sched.add(long)
    chunks = []
    while long.num_uncomputed > 1:
        chunks += [n for s, n in step(sched).prefills if s is long]
    assert chunks[0] == 63  # nothing cached yet: tokens only
    assert chunks[1] > chunks[5] > chunks[-2]  # later chunks attend to more context: fewer tokens per step
    alone = make_scheduler(
        max_num_batched_tokens=64, num_blocks=512, max_model_len=2048, attn_cost_context=64.0
    )
    solo = seq(600)
    alone.add(solo)
    assert [n for _ in range(3) for s, n in step(alone).prefills] == [64, 64, 64]  # nobody waits: full budget


def test_chunk_cost():
    assert chunk_cost(100, 10, None) == 10
    assert chunk_cost(100, 10, 50.0) == 10 * (1 + 105 / 50)
    for ctx in (0, 300):  # chunk_within_cost is its inverse
        n = chunk_within_cost(ctx, 96, 50.0)
        assert chunk_cost(ctx, n, 50.0) <= 96 < chunk_cost(ctx, n + 1, 50.0)


def long_prefill_scheduler(**kw):
    """Budget 64: prompts over 32 tokens are long and their chunks cost at most 24 per step while others run."""
    kw = dict(max_num_batched_tokens=64, num_blocks=1024, max_model_len=2048, max_num_seqs=32, **kw)
    return make_scheduler(long_prefill_threshold=32, long_prefill_budget=24, **kw)


def busy_long_prefill_scheduler(**kw):
    """long_prefill_scheduler with one sequence decoding for a long while: other work is in the engine."""
    sched = long_prefill_scheduler(**kw)
    other = seq(4, max_tokens=500, start=9000)
    sched.add(other)
    step(sched)
    return sched, other


def test_long_prompt_chunks_are_capped_while_others_run():
    sched, other = busy_long_prefill_scheduler(attn_cost_context=100.0)
    long = seq(300)
    sched.add(long)
    chunks = []
    while long.num_uncomputed > 1:
        batch = step(sched)
        assert batch.decodes == [other]
        for s, n in batch.prefills:
            ctx = s.num_computed_tokens - n  # postprocess already counted the chunk
            assert n == 1 or chunk_cost(ctx, n, 100.0) <= 24  # never more than the long budget
            chunks.append(n)
    assert chunks[0] == 21 and chunks[-1] < chunks[1]  # 21 fresh tokens cost 23.2; later ones attend to more
    alone = long_prefill_scheduler(attn_cost_context=100.0)
    solo = seq(300)
    alone.add(solo)
    assert [n for s, n in step(alone).prefills] == [64]  # nothing else in the engine: the whole budget


def test_short_prompts_go_before_long_ones_and_long_chunks_ride_only_within_their_ride_limit():
    sched, other = busy_long_prefill_scheduler()
    long = seq(200)
    sched.add(long)
    for _ in range(5):
        assert step(sched).prefills == [(long, 24)]
    short = seq(30, start=500)  # more tokens left than the long prompt's next chunk, yet first
    sched.add(short)  # due in 60 ms, but its step may end within 1.25 x its own 30 ms (+ 1 decode): 7 ride
    assert step(sched).prefills == [(short, 30), (long, 7)]
    late = seq(30, start=600)
    sched.add(late, arrival=sched.clock() - 1.0)
    assert step(sched).prefills == [(late, 30)]  # its first token comes from a step without long work
    assert step(sched).prefills == [(long, 24)]


def test_a_long_prompt_behind_its_deadline_rides_up_to_the_short_ones_deadline():
    """Once its slack is less than its remaining prefill again, a long prompt's chunk may use the room up to the
    short prompt's deadline (the old, looser rule), so a stream of short prompts cannot push it past its own."""
    sched, other = busy_long_prefill_scheduler()
    long = seq(200)
    sched.add(long)
    step(sched)
    sched.clock.t = sched.deadline(long) - 0.3  # 176 tokens left: about 0.2 s of prefill, 0.3 s of slack
    short = seq(30, start=500)
    sched.add(short)
    assert step(sched).prefills == [(short, 30), (long, 24)]


def test_a_long_prompt_stays_long_to_its_last_chunk():
    """Its last chunks are as small as a short prompt but still count against the long budget."""
    sched, other = busy_long_prefill_scheduler()
    long = seq(40)
    sched.add(long)
    assert step(sched).prefills == [(long, 24)]
    short = seq(20, start=500)  # more tokens than the long prompt has left (16)
    sched.add(short, arrival=sched.clock() - 1.0)
    assert step(sched).prefills == [(short, 20)]
    assert long.seq_id in sched.long_prefills
    assert step(sched).prefills == [(long, 16)]


def test_several_long_prompts_share_one_long_budget():
    sched, other = busy_long_prefill_scheduler()
    a, b = seq(100), seq(120, start=1000)
    sched.add(a)
    sched.add(b)
    assert step(sched).prefills == [(a, 24)]  # shortest first; the budget is spent
    assert step(sched).prefills == [(a, 24)]


def test_a_prefix_cache_hit_can_make_a_long_prompt_short():
    sched, other = busy_long_prefill_scheduler(block_size=4)
    first = seq(36, max_tokens=1, start=100)
    sched.add(first)
    while not first.is_finished:
        step(sched)
    again = seq(36, max_tokens=1, start=100)  # 32 of its 36 tokens are cached: 4 left to compute
    sched.add(again)
    assert step(sched).prefills == [(again, 4)]
    assert again.seq_id not in sched.long_prefills


def test_long_prefill_limits_follow_the_budget_on_fast_devices_and_time_on_slow_ones():
    fast = long_prefill_limits(2048, in_step=100_000)  # a GPU: the step-time bound is 100k tokens
    assert fast == LongPrefillLimits(threshold=1024, budget=768, budget_alone=2048)
    slow = long_prefill_limits(2048, in_step=130)  # the 2-core CPU
    assert slow == LongPrefillLimits(threshold=260, budget=130, budget_alone=130)
    assert long_prefill_limits(256, 130) == LongPrefillLimits(threshold=128, budget=96, budget_alone=130)


def test_a_lone_long_prompt_is_capped_by_the_alone_budget():
    """Nothing else in the engine, yet a short request may arrive mid-step: the step stays short."""
    sched = long_prefill_scheduler(long_prefill_budget_alone=40)
    long = seq(300)
    sched.add(long)
    assert [n for s, n in step(sched).prefills] == [40]
    short = seq(10, start=500)
    sched.add(short, arrival=sched.clock() - 1.0)
    assert step(sched).prefills == [(short, 10)]  # first, in a step without long work
    assert step(sched).prefills == [
        (long, 24)
    ]  # others in the engine now (short decodes): the crowded budget


def test_max_num_seqs_caps_the_batch():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    seqs = [seq(2, max_tokens=5, start=i * 10) for i in range(5)]
    for s in seqs:
        sched.add(s)
    for _ in range(3):
        step(sched)
        assert len(sched.running) <= 3
    assert sum(s.status is SequenceStatus.RUNNING for s in seqs) == 3
    run_all(sched)
    assert all(s.is_finished for s in seqs)


def test_max_num_seqs_is_capped_by_the_token_budget():
    sched = make_scheduler(max_num_seqs=64, max_num_batched_tokens=16)
    assert sched.max_num_seqs == 16


def test_preemption_victim_is_the_most_recently_admitted():
    # 6 blocks of 4: three 8-token prompts take 2 blocks each; the first decode needs a third
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_model_len=24)
    sched.watermark_blocks = 0
    a, b, c = (seq(8, max_tokens=6, start=i * 100, rid=str(i)) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    assert sched.running == [a, b, c]
    batch = step(sched)
    assert batch.preempted == [c] and sched.num_preemptions == 1
    assert sched.waiting[0] is c and c.status is SequenceStatus.WAITING and not c.block_table
    assert c.num_preemptions == 1 and c.num_output_tokens == 1  # keeps its token; recomputed later
    run_all(sched)
    assert all(s.is_finished and s.num_output_tokens == 6 for s in (a, b, c))
    assert sched.bm.num_free_blocks == 6


def test_preempted_sequence_goes_back_first():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_model_len=24)
    sched.watermark_blocks = 0
    a, b, c = (seq(8, max_tokens=6, start=i * 100) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    step(sched)  # c preempted
    late = seq(2, start=900)
    sched.add(late)
    order = sched._prefill_order()
    assert order[0] is c


def test_abort_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=16)
    a, b = seq(9), seq(5, start=100)
    sched.add(a)
    sched.add(b)
    step(sched)
    free = sched.bm.num_free_blocks
    sched.finish(a, "abort")
    assert sched.bm.num_free_blocks == free + 3
    assert a not in sched.running and a.finish_reason == "abort"
    sched.finish(b, "abort")
    assert sched.bm.num_free_blocks == 16 and not sched.has_unfinished()


def test_abort_of_a_waiting_sequence():
    sched = make_scheduler()
    a = seq(4)
    sched.add(a)
    sched.finish(a, "abort")
    assert not sched.waiting and a.is_finished


def test_finished_sequences_leave_at_once():
    sched = make_scheduler()
    a = seq(4, max_tokens=1)
    sched.add(a)
    step(sched)
    assert a.is_finished and not sched.running and sched.bm.num_free_blocks == sched.bm.num_blocks


def test_never_fits_is_rejected_at_once():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ContextLengthError):
        sched.check_fits(90, 20)
    with pytest.raises(CapacityError):
        sched.check_fits(10, 7)  # 17 tokens > 16 in the whole cache
    sched.check_fits(10, 6)


def test_a_request_as_big_as_the_whole_cache_still_runs():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    s = seq(10, max_tokens=6)
    sched.check_fits(10, 6)
    sched.add(s)
    run_all(sched)
    assert s.num_output_tokens == 6


def test_n_forks_share_the_prompt_blocks():
    sched = make_scheduler(num_blocks=32)
    parent = seq(6, max_tokens=3, n=3)
    sched.add(parent)
    batch = sched.schedule()
    assert len(batch.forks) == 2
    assert [row for _, row in batch.samples] == [0, 0, 0]  # all three sample from the prompt's logits
    children = [c for _, c in batch.forks]
    assert all(c.block_table == parent.block_table for c in children)
    assert sched.bm.blocks[parent.block_table[0]].ref_count == 3
    sched.postprocess(batch)
    for i, (s, _) in enumerate(batch.samples):
        s.append(i)
    batch = step(sched)
    assert len(batch.decodes) == 3
    assert len(batch.blocks_to_copy) == 2  # the partial prompt block: copy on write for all but the last
    run_all(sched)
    assert sched.bm.num_free_blocks == 32


def test_n_reserves_sequence_slots():
    sched = make_scheduler(max_num_seqs=4)
    sched.add(seq(3, n=3))
    sched.add(seq(3, n=2, start=50))
    batch = sched.schedule()
    assert len(batch.prefills) == 1  # 3 + 2 slots > 4
