"""Paged KV blocks: free list, reference counts, per-sequence block tables, prefix caching.

Prefix caching: a full block is keyed by a chained hash (previous block's hash + its token ids), registered only
once its K/V are computed, and verified by token ids on a hit. Lazy eviction: a freed block keeps its hash and can
be revived by a hit until a fresh allocation reuses it (blocks without a hash are reused first, then the least
recently freed). Hit/query counters are in tokens. Pure Python, no torch.
"""

from __future__ import annotations

from llmdeploy.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id, self.ref_count = block_id, 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


class Blocks(dict):
    """block id -> Block, each made when first asked for: an engine holds up to ~10^5-10^6 blocks, and making them
    all at start took 0.45 s per 131,072 (the default 1 GiB cache of a tiny model); iterating yields only the
    blocks made so far, which are the only ones that can hold a hash."""

    def __missing__(self, block_id: int) -> Block:
        block = self[block_id] = Block(block_id)
        return block

    def __iter__(self):
        return iter(self.values())


def chain_hash(prev: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.blocks = Blocks()
        # ordered sets (dicts): unhashed free blocks are reused before cached ones; cached ones in LRU order
        self.free_plain: dict[int, None] = dict.fromkeys(range(num_blocks))
        self.free_cached: dict[int, None] = {}
        self.hash_to_block: dict[int, int] = {}
        self.num_queries = self.num_hits = 0  # tokens

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # prefix cache
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        hashes, bs = seq.block_hashes, self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(
                chain_hash(hashes[-1] if hashes else None, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            )
        return hashes[:num_blocks]

    def _match(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix; at least one token is left to compute (it yields the logits)."""
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position's logits: nothing may be skipped
        bs, hit = self.block_size, []
        for i, h in enumerate(self._hashes(seq, (len(seq) - 1) // bs)):
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(
                seq.token_ids[i * bs : (i + 1) * bs]
            ):
                break
            hit.append(block_id)
        return hit

    def _take_free(self) -> Block:
        pool = self.free_plain or self.free_cached
        block = self.blocks[next(iter(pool))]
        del pool[block.block_id]
        if block.hash is not None:  # evict: a cached block is reused for new content
            if self.hash_to_block.get(block.hash) == block.block_id:
                del self.hash_to_block[block.hash]
            block.hash = block.token_ids = None
        block.ref_count = 1
        return block

    def _share(self, block: Block) -> None:
        if block.ref_count == 0:  # revive a freed but still cached block
            del self.free_cached[block.block_id]
        block.ref_count += 1

    # admission
    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        hit = self._match(seq)
        revived = sum(1 for b in hit if self.blocks[b].ref_count == 0)
        return self.num_free_blocks >= self.blocks_for(len(seq)) - len(hit) + revived + reserve

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of seq's tokens; a prefix hit skips computing those tokens."""
        assert not seq.block_table
        hit = self._match(seq)
        for b in hit:
            self._share(self.blocks[b])
        fresh = [self._take_free().block_id for _ in range(self.blocks_for(len(seq)) - len(hit))]
        seq.block_table = hit + fresh
        seq.num_computed_tokens = len(hit) * self.block_size
        seq.num_registered_blocks = len(hit)
        if self.prefix_caching:
            self.num_queries += len(seq)
            self.num_hits += seq.num_computed_tokens
        if not seq.admitted_once:
            seq.num_cached_tokens = seq.num_computed_tokens

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):  # tail first: shared prefixes stay cached longest
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                (self.free_cached if block.hash is not None else self.free_plain)[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register seq's full blocks whose K/V are now computed, so later prompts can reuse them."""
        if not self.prefix_caching:
            return
        bs, full = self.block_size, seq.num_computed_tokens // self.block_size
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.hash_to_block:
                block.hash, block.token_ids = hashes[i], tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self.hash_to_block[hashes[i]] = block.block_id
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (benchmarks, weight reloads); only while no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.hash = block.token_ids = None
        self.hash_to_block.clear()
        self.free_plain = dict.fromkeys(range(self.num_blocks))
        self.free_cached = {}
        return True

    # decode growth
    def _needs_block(self, seq: Sequence) -> bool:
        """The next token's K/V lands in a new block, or in a partial block shared after a fork (copy on write)."""
        i = (len(seq) - 1) // self.block_size
        return i >= len(seq.block_table) or self.blocks[seq.block_table[i]].ref_count > 1

    def can_append(self, seq: Sequence) -> bool:
        return not self._needs_block(seq) or self.num_free_blocks >= 1

    def may_append(self, seq: Sequence) -> tuple[int, int] | None:
        """Make room for seq's last token; returns (src, dst) when a shared block must be copied first."""
        i = (len(seq) - 1) // self.block_size
        if i >= len(seq.block_table):
            seq.block_table.append(self._take_free().block_id)
            return None
        src = self.blocks[seq.block_table[i]]
        if src.ref_count == 1:
            return None
        dst = self._take_free()
        src.ref_count -= 1
        seq.block_table[i] = dst.block_id
        return src.block_id, dst.block_id

    def reserve_ahead(self, seqs: list[Sequence], tokens: int) -> bool:
        """Blocks for each sequence's next `tokens` positions after its last token (a decode burst writes them
        before the scheduler sees them), all or none. The last token's own block is may_append's; the reserved
        blocks are ordinary table entries: later appends use them, deallocate frees them."""
        need = [self.blocks_for(len(s) + tokens) - len(s.block_table) for s in seqs]
        if sum(max(0, n) for n in need) > self.num_free_blocks:
            return False
        for seq, n in zip(seqs, need, strict=True):
            seq.block_table.extend(self._take_free().block_id for _ in range(n))
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
