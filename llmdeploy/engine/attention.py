"""Attention metadata for one engine step and the paged attention layer that consumes it.

Token order in a step: all prefill-chunk tokens first (sequence by sequence), then one token per decoding
sequence. The runner builds AttentionMetadata; model code only passes it through to PagedAttention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmdeploy.kernels import get_ops


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not store
    num_prefill_tokens: int
    num_decode_tokens: int
    # prefill part (None when no prefill in this step)
    prefill_cu_seqlens_q: torch.Tensor | None = None  # [P + 1] int32
    prefill_context_lens: torch.Tensor | None = None  # [P] int32, cache length after this chunk
    prefill_block_tables: torch.Tensor | None = None  # [P, max_blocks] int32
    prefill_max_q_len: int = 0
    prefill_max_context_len: int = 0
    # decode part (None when no decode in this step)
    decode_context_lens: torch.Tensor | None = None  # [D] int32, including the new token
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] int32
    decode_max_context_len: int = 0


class PagedAttention(nn.Module):
    """Stores this step's K/V into the layer's paged cache, then attends over the cache."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: str = "torch"
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale
        self.ops = get_ops(backend)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [N, H, D], k/v: [N, Hkv, D] -> [N, H, D]."""
        self.ops.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q [N, H, D] over the cache, this step's K/V already stored in it."""
        ops = self.ops
        p = meta.num_prefill_tokens
        parts = []
        if p:
            parts.append(
                ops.paged_prefill_attention(
                    q[:p],
                    self.k_cache,
                    self.v_cache,
                    meta.prefill_cu_seqlens_q,
                    meta.prefill_context_lens,
                    meta.prefill_block_tables,
                    self.scale,
                    meta.prefill_max_q_len,
                    meta.prefill_max_context_len,
                )
            )
        if meta.num_decode_tokens:
            parts.append(
                ops.paged_attention_decode(
                    q[p:],
                    self.k_cache,
                    self.v_cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    self.scale,
                    meta.decode_max_context_len,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)
