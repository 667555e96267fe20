"""Pure-PyTorch reference ops. They define what each Triton kernel must compute, and they are the CPU path.

Shapes (the contract shared with kernels/triton_ops.py and engine/attention.py):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (one pair per layer)
  slot_mapping:     [num_tokens] int64, slot = block_id * block_size + offset; -1 = do not store
  block_tables:     [num_seqs, max_blocks] int32, padded with 0 (never read past context_lens)
  context_lens:     [num_seqs] int32, tokens in the cache for that sequence *including* this step's tokens
  cu_seqlens_q:     [num_seqs + 1] int32, prefix sums of the query chunk lengths (prefill)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim] -> written into the paged cache at slot_mapping."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[keep].to(v_cache.dtype))


def gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, max_context_len: int
) -> torch.Tensor:
    """[num_seqs, max_blocks] block ids -> [num_seqs, max_context_len, num_kv_heads, head_dim] (padded rows are garbage)."""
    block_size = cache.shape[1]
    num_blocks = -(-max_context_len // block_size)
    tables = block_tables[:, :num_blocks].long()
    gathered = cache[tables]  # [S, nb, bs, H, D]
    return gathered.flatten(1, 2)[:, :max_context_len]


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """query: [num_seqs, num_heads, head_dim], one token per sequence (the last position) -> same shape."""
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    k = gather_kv(k_cache, block_tables, max_context_len).transpose(1, 2)  # [S, Hkv, L, D]
    v = gather_kv(v_cache, block_tables, max_context_len).transpose(1, 2)
    valid = torch.arange(max_context_len, device=query.device)[None, :] < context_lens[:, None]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2).to(k.dtype), k, v, attn_mask=valid[:, None, None, :], scale=scale,
        enable_gqa=k.shape[1] != query.shape[1],
    )
    return out.squeeze(2).to(query.dtype)


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
    """query: [num_tokens, num_heads, head_dim], chunks of several sequences back to back.

    Chunk i holds the last q_len_i positions of a sequence whose cache has context_lens[i] tokens (earlier
    chunks and prefix-cache hits included; this chunk's K/V already stored). Causal: query j of the chunk sees
    keys 0 .. context_len - q_len + j.
    """
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for i, ctx in enumerate(lens):
        q0, q1 = starts[i], starts[i + 1]
        q_len = q1 - q0
        k = gather_kv(k_cache, block_tables[i : i + 1], ctx)[0].transpose(0, 1)  # [Hkv, L, D]
        v = gather_kv(v_cache, block_tables[i : i + 1], ctx)[0].transpose(0, 1)
        q = query[q0:q1].transpose(0, 1).to(k.dtype)  # [H, q_len, D]
        pos_q = torch.arange(ctx - q_len, ctx, device=query.device)[:, None]
        allowed = torch.arange(ctx, device=query.device)[None, :] <= pos_q
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=k.shape[0] != q.shape[0])
        out[q0:q1] = o.transpose(0, 1).to(query.dtype)
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual) normalised; returns (normed, new residual) so layers can chain the fused form."""
    if residual is not None:
        x = x + residual
    residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.to(x.dtype) * weight), residual


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (half-split) rotary as in HF Llama. query: [N, H, D], key: [N, Hkv, D];
    cos_sin_cache: [max_pos, D] = cat(cos[:, :D/2], sin[:, :D/2]) in float32."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(query), rotate(key)
