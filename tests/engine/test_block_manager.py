from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from llmdeploy.engine import block_manager as bm_mod
from llmdeploy.engine.block_manager import BlockManager
from llmdeploy.engine.sequence import Sequence, SequenceStatus
from tests.engine.sim import make_scheduler, seq


def computed(bm: BlockManager, s: Sequence) -> None:
    """Pretend the forward ran over all of s's tokens."""
    s.num_computed_tokens = len(s)
    bm.cache_computed_blocks(s)


def test_allocate_and_free_all():
    bm = BlockManager(10, 4)
    s = Sequence(list(range(10)))
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    bm.deallocate(s)
    assert bm.num_free_blocks == 10 and all(b.ref_count == 0 for b in bm.blocks)


def test_cannot_allocate_beyond_free_blocks():
    bm = BlockManager(3, 4)
    assert not bm.can_allocate(Sequence(list(range(13))))
    assert bm.can_allocate(Sequence(list(range(12))))
    assert not bm.can_allocate(Sequence(list(range(12))), reserve=1)


def test_prefix_hit_shares_full_blocks_and_counts_tokens():
    bm = BlockManager(16, 4)
    a = Sequence(list(range(10)))
    bm.allocate(a)
    assert bm.num_hits == 0 and bm.num_queries == 10
    computed(bm, a)
    b = Sequence(list(range(8)) + [99, 98, 97])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert bm.num_hits == 8 and bm.num_queries == 21
    assert bm.blocks[a.block_table[0]].ref_count == 2


def test_blocks_are_registered_only_once_computed():
    bm = BlockManager(16, 4)
    a = Sequence(list(range(12)))
    bm.allocate(a)  # admitted, K/V not computed yet
    b = Sequence(list(range(12)))
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_last_token_is_always_recomputed():
    bm = BlockManager(16, 4)
    a = Sequence(list(range(8)))
    bm.allocate(a)
    computed(bm, a)
    b = Sequence(list(range(8)))  # identical prompt, block-aligned
    bm.allocate(b)
    assert b.num_computed_tokens == 4  # the second block is recomputed: its last token yields the logits


def test_hash_collision_is_caught_by_token_check(monkeypatch):
    monkeypatch.setattr(bm_mod, "chain_hash", lambda prev, ids: 42)  # every block collides
    bm = BlockManager(16, 4)
    a = Sequence([1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a)
    b = Sequence([9, 9, 9, 9, 5])
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(a.block_table) & set(b.block_table)


def test_freed_block_keeps_hash_and_is_revived():
    bm = BlockManager(4, 4)
    a = Sequence(list(range(9)))
    bm.allocate(a)
    computed(bm, a)
    first = a.block_table[0]
    bm.deallocate(a)
    assert bm.num_free_blocks == 4 and bm.blocks[first].hash is not None
    b = Sequence(list(range(4)) + [50, 51])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[0] == first and b.num_computed_tokens == 4
    assert bm.num_free_blocks == 2


def test_plain_free_blocks_are_reused_before_cached_ones():
    bm = BlockManager(4, 4)
    a = Sequence(list(range(5)))  # one full (cached) block + one partial
    bm.allocate(a)
    computed(bm, a)
    cached = a.block_table[0]
    bm.deallocate(a)
    other = Sequence([100 + i for i in range(12)])  # needs 3 of the 4 blocks
    bm.allocate(other)
    assert cached not in other.block_table
    assert bm.blocks[cached].hash is not None


def test_eviction_drops_the_hash():
    bm = BlockManager(2, 4)
    a = Sequence(list(range(5)))
    bm.allocate(a)
    computed(bm, a)
    bm.deallocate(a)
    bm.allocate(Sequence([100 + i for i in range(8)]))  # takes both blocks: the cached one is evicted
    assert not bm.hash_to_block
    assert all(b.hash is None for b in bm.blocks)


def test_reset_prefix_cache_only_when_idle():
    bm = BlockManager(4, 4)
    a = Sequence(list(range(9)))
    bm.allocate(a)
    computed(bm, a)
    assert not bm.reset_prefix_cache()
    bm.deallocate(a)
    assert bm.reset_prefix_cache() and not bm.hash_to_block
    b = Sequence(list(range(9)))
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_prefix_caching_off_never_shares():
    bm = BlockManager(16, 4, prefix_caching=False)
    a = Sequence(list(range(10)))
    bm.allocate(a)
    computed(bm, a)
    b = Sequence(list(range(10)))
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and bm.num_queries == 0 and not bm.hash_to_block


def test_may_append_adds_a_block_at_the_boundary():
    bm = BlockManager(8, 4)
    s = Sequence(list(range(4)))
    bm.allocate(s)
    computed(bm, s)
    s.append(7)
    assert bm.can_append(s)
    assert bm.may_append(s) is None and len(s.block_table) == 2


def test_fork_then_copy_on_write_of_the_shared_partial_block():
    bm = BlockManager(8, 4)
    parent = Sequence(list(range(6)))
    bm.allocate(parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    computed(bm, parent)
    child.num_computed_tokens = 6
    assert bm.blocks[parent.block_table[1]].ref_count == 2
    parent.append(1)
    child.append(2)
    copy = bm.may_append(parent)
    assert copy == (child.block_table[1], parent.block_table[1])
    assert bm.may_append(child) is None  # now the only holder: writes in place
    assert bm.blocks[child.block_table[1]].ref_count == 1
    assert parent.block_table[0] == child.block_table[0] and bm.blocks[parent.block_table[0]].ref_count == 2
    bm.deallocate(parent)
    bm.deallocate(child)
    assert bm.num_free_blocks == 8


# --- property test: random add / step / finish / abort / preempt over the real scheduler


def check_invariants(sched) -> None:
    bm = sched.bm
    holders: dict[int, list[tuple[Sequence, int]]] = {}
    for s in sched.running:
        assert s.status is SequenceStatus.RUNNING
        for i, b in enumerate(s.block_table):
            holders.setdefault(b, []).append((s, i))
    for s in sched.waiting:
        assert not s.block_table and s.status is SequenceStatus.WAITING
    free = set(bm.free_plain) | set(bm.free_cached)
    for block in bm.blocks:
        held = holders.get(block.block_id, [])
        assert block.ref_count == len(held), (block.block_id, block.ref_count, held)
        assert (block.ref_count == 0) == (block.block_id in free)
        if block.hash is not None and block.block_id in bm.hash_to_block.values():
            assert bm.hash_to_block[block.hash] == block.block_id
        bs = bm.block_size
        spans = []
        for s, i in held:  # the tokens whose K/V this block holds for that sequence
            end = min((i + 1) * bs, s.num_computed_tokens)
            spans.append(tuple(s.token_ids[i * bs : end]))
        if len(held) > 1:  # shared: every holder sees the same content in it
            longest = max(spans, key=len)
            assert all(longest[: len(sp)] == sp for sp in spans), spans
        if block.hash is not None and held:
            full = [tuple(s.token_ids[i * bs : (i + 1) * bs]) for s, i in held]
            assert all(f == block.token_ids for f in full)


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "step", "step", "step", "step", "abort", "preempt"]),
        st.integers(0, 10**6),
    ),
    min_size=1,
    max_size=80,
)


def run_ops(ops, num_blocks: int, budget: int) -> object:
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        max_model_len=num_blocks * 4,
        aging_steps=5,
    )
    rng = random.Random(0)
    live: list[Sequence] = []
    for op, x in ops:
        r = random.Random(x)
        if op == "add":
            n_prompt, max_tokens = r.randint(1, 14), r.randint(1, 16)
            prefix = [1, 2, 3, 4, 5, 6, 7, 8][: r.randint(0, 8)]  # shared system prompt
            s = Sequence(prefix + [r.randrange(40) for _ in range(n_prompt)], None, f"r{x}")
            s.params.max_tokens, s.params.n = max_tokens, r.choice([1, 1, 2])
            s.num_forks = s.params.n - 1
            if len(s) + max_tokens <= num_blocks * 4:
                sched.add(s)
                live.append(s)
        elif op == "step":
            batch = sched.schedule()
            check_invariants(sched)
            sched.postprocess(batch)
            for s, _ in batch.samples:
                if s not in live:
                    live.append(s)
                s.append(rng.randrange(40))
                if s.num_output_tokens >= s.params.max_tokens or r.random() < 0.05:
                    sched.finish(s, "length")
        elif op == "abort" and live:
            sched.finish(r.choice(live), "abort")
        elif op == "preempt" and sched.running:
            sched.preempt(r.choice(sched.running))
        check_invariants(sched)
    for s in list(sched.running) + list(sched.waiting):
        sched.finish(s, "abort")
    assert sched.bm.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in sched.bm.blocks)
    assert not sched.running and not sched.waiting
    return sched


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(6, 16), budget=st.sampled_from([4, 8, 32]))
def test_random_workloads_leave_no_block_behind(ops, num_blocks, budget):
    run_ops(ops, num_blocks, budget)


def test_long_random_walk_with_natural_preemption():
    r = random.Random(1)
    kinds = ["add", "add", "step", "step", "step", "step", "step", "abort"]
    sched = run_ops([(r.choice(kinds), r.randrange(10**6)) for _ in range(3000)], num_blocks=12, budget=8)
    assert sched.num_preemptions > 10 and sched.bm.num_hits > 0


def test_run_to_completion_frees_everything_under_preemption():
    sched = make_scheduler(
        num_blocks=10, block_size=4, max_num_seqs=6, max_num_batched_tokens=16, max_model_len=40
    )
    for i in range(6):
        sched.add(seq(6, max_tokens=10, start=i * 100))
    from tests.engine.sim import run_all

    run_all(sched)
    assert sched.num_preemptions > 0
    assert sched.bm.num_free_blocks == 10 and all(b.ref_count == 0 for b in sched.bm.blocks)


def test_reserve_ahead_is_all_or_nothing_and_freed_with_the_sequence():
    """A decode burst's later positions get their blocks before the burst writes them; too few free blocks for
    every sequence reserves none; the reserved blocks are ordinary table entries (used by later appends, freed on
    deallocate)."""
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = seq(7), seq(3)
    bm.allocate(a), bm.allocate(b)  # 2 + 1 blocks
    assert bm.reserve_ahead([a, b], 3)  # a: positions up to 9 (3 blocks); b: up to 5 (2 blocks)
    assert (len(a.block_table), len(b.block_table), bm.num_free_blocks) == (3, 2, 1)
    assert bm.reserve_ahead([a, b], 3)  # already covered: nothing taken
    assert bm.num_free_blocks == 1
    assert not bm.reserve_ahead([a, b], 6)  # needs 1 + 1 > 1 free: none taken
    assert (len(a.block_table), len(b.block_table), bm.num_free_blocks) == (3, 2, 1)
    for _ in range(3):
        a.append(1)
        assert bm.may_append(a) is None  # lands in a reserved block
    assert bm.num_free_blocks == 1
    bm.deallocate(a), bm.deallocate(b)
    assert bm.num_free_blocks == 6
