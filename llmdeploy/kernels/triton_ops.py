"""Triton kernels behind the op names and signatures of kernels/reference.py (see docs/CONTRACTS.md §1).

They run compiled on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (set before this module is
imported), which is how CI checks them against the reference.
"""

from __future__ import annotations

import torch

from llmdeploy.kernels.triton_decode import decode_attention
from llmdeploy.kernels.triton_kv import store_kv
from llmdeploy.kernels.triton_norm import rms_norm, rotary_embedding
from llmdeploy.kernels.triton_prefill import prefill_attention

__all__ = ["store_kv", "paged_attention_decode", "paged_prefill_attention", "rms_norm", "rotary_embedding"]


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """query: [num_seqs, num_heads, head_dim], one token per sequence -> same shape (split-K chosen by size)."""
    return decode_attention(
        query, k_cache, v_cache, block_tables, context_lens, scale, max_context_len or None
    )


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim], causal chunks back to back over the paged cache."""
    return prefill_attention(
        query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, max_q_len, max_context_len
    )
