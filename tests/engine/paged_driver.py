"""A minimal stand-in for the model runner, for model tests and bench/forward_cpu.py: per-layer paged K/V caches,
fixed block tables per sequence (deliberately not contiguous), and AttentionMetadata for mixed steps (prefill
chunks first, then one token per decoding sequence)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmdeploy.engine.attention import AttentionMetadata


@dataclass
class Seq:
    block_table: list[int]
    num_cached: int = 0  # tokens whose K/V are in the cache
    tokens: list[int] = field(default_factory=list)


class PagedDriver:
    def __init__(self, model, arch, dtype: torch.dtype, max_seqs: int, max_len: int, block_size: int = 16):
        self.model, self.block_size = model, block_size
        blocks_per_seq = -(-max_len // block_size)
        num_blocks = max_seqs * blocks_per_seq + 1
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        for layer in model.attention_layers():
            layer.k_cache = torch.zeros(shape, dtype=dtype)
            layer.v_cache = torch.zeros(shape, dtype=dtype)
        # interleave sequences' blocks and skip block 0 so paging bugs cannot hide behind a contiguous layout
        self.free_tables = [
            [1 + j * max_seqs + i for j in range(blocks_per_seq)][::-1] for i in range(max_seqs)
        ]

    def new_seq(self, prompt: list[int]) -> Seq:
        return Seq(self.free_tables.pop(0), tokens=list(prompt))

    def step(self, prefills: list[tuple[Seq, int]], decodes: list[Seq]) -> torch.Tensor:
        """prefills: (seq, chunk length) over the seq's uncached tokens; decodes: seqs whose last token is new.
        Returns float32 logits of the last token of each prefill chunk and each decode, in that order."""
        hidden, last_rows = self.forward(prefills, decodes)
        return self.model.compute_logits(hidden[torch.tensor(last_rows)])

    def forward(self, prefills: list[tuple[Seq, int]], decodes: list[Seq]) -> tuple[torch.Tensor, list[int]]:
        """-> (hidden of every token of the step, row of each chunk's / decode's last token)."""
        ids, pos, meta, last_rows = self.inputs(prefills, decodes)
        return self.model(ids, pos, meta), last_rows

    def decode_logits(self, decodes: list[Seq]) -> torch.Tensor | None:
        """The model's one-call decode step (decode_logits): float32 logits of each decode, or None."""
        ids, pos, meta, _ = self.inputs([], decodes)
        return self.model.decode_logits(ids, pos, meta)

    def inputs(self, prefills: list[tuple[Seq, int]], decodes: list[Seq]):
        """-> (input ids, positions, metadata, row of each chunk's / decode's last token); marks them cached."""
        ids, pos, slots, last_rows = [], [], [], []
        for seq, n in prefills:
            self._add_tokens(seq, n, ids, pos, slots)
            last_rows.append(len(ids) - 1)
        for seq in decodes:
            self._add_tokens(seq, 1, ids, pos, slots)
            last_rows.append(len(ids) - 1)
        meta = self.metadata(prefills, decodes, slots)
        return torch.tensor(ids), torch.tensor(pos), meta, last_rows

    def _add_tokens(self, seq: Seq, n: int, ids: list, pos: list, slots: list) -> None:
        start = seq.num_cached
        for p in range(start, start + n):
            ids.append(seq.tokens[p])
            pos.append(p)
            slots.append(seq.block_table[p // self.block_size] * self.block_size + p % self.block_size)
        seq.num_cached += n

    def metadata(
        self, prefills: list[tuple[Seq, int]], decodes: list[Seq], slots: list[int]
    ) -> AttentionMetadata:
        num_prefill = sum(n for _, n in prefills)
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64), num_prefill, len(decodes))
        if prefills:
            q_lens = [n for _, n in prefills]
            meta.prefill_cu_seqlens_q = torch.tensor([0] + list(_cumsum(q_lens)), dtype=torch.int32)
            meta.prefill_context_lens = torch.tensor([s.num_cached for s, _ in prefills], dtype=torch.int32)
            meta.prefill_block_tables = self._tables([s for s, _ in prefills])
            meta.prefill_max_q_len = max(q_lens)
            meta.prefill_max_context_len = max(s.num_cached for s, _ in prefills)
        if decodes:
            meta.decode_context_lens = torch.tensor([s.num_cached for s in decodes], dtype=torch.int32)
            meta.decode_block_tables = self._tables(decodes)
            meta.decode_max_context_len = max(s.num_cached for s in decodes)
        return meta

    def _tables(self, seqs: list[Seq]) -> torch.Tensor:
        width = max(-(-s.num_cached // self.block_size) for s in seqs)
        return torch.tensor([s.block_table[:width] for s in seqs], dtype=torch.int32)

    def generate_greedy(
        self, prompts: list[list[int]], max_new_tokens: int, chunk: int | None = None
    ) -> list[list[int]]:
        """All prompts batched: prefill everything (in chunks of `chunk` tokens per sequence), then decode."""
        seqs = [self.new_seq(p) for p in prompts]
        outs: list[list[int]] = [[] for _ in seqs]
        while any(s.num_cached < len(s.tokens) for s in seqs):
            pending = [
                (s, min(chunk or 1 << 30, len(s.tokens) - s.num_cached))
                for s in seqs
                if s.num_cached < len(s.tokens)
            ]
            logits = self.step(pending, [])
            for (s, _), row in zip(pending, logits, strict=True):
                if s.num_cached == len(s.tokens):
                    i = seqs.index(s)
                    outs[i].append(int(row.argmax()))
        for _ in range(max_new_tokens - 1):
            for s, o in zip(seqs, outs, strict=True):
                s.tokens.append(o[-1])
            logits = self.step([], seqs)
            for o, row in zip(outs, logits, strict=True):
                o.append(int(row.argmax()))
        return outs


def _cumsum(xs: list[int]):
    total = 0
    for x in xs:
        total += x
        yield total
