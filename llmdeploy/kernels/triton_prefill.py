"""Paged prefill attention: variable-length causal attention for prompt chunks over the paged cache.

Chunk i holds the last q_len_i positions of a sequence with context_lens[i] cached tokens (its own K/V already
stored), so prefix-cache hits and earlier chunks are read from the same block table as the chunk itself.
Grid (query head, query tile, sequence): heads vary fastest so programs sharing a KV head run together and
reuse its tiles from L2. Keys strictly before the tile's first query position need no causal mask; only the
tiles on the diagonal are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmdeploy.kernels.triton_common import attend_paged, check_device, dot_args, head_block

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    Q,
    K,
    V,
    CuSeqlensQ,
    ContextLens,
    BlockTables,
    Out,
    scale_log2,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_on,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    head = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(CuSeqlensQ + seq)
    q_len = tl.load(CuSeqlensQ + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(ContextLens + seq)
    kv_head = head // GROUP

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    tokens = (q_start + offs_m).to(tl.int64)
    q_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + tokens[:, None] * stride_qn + head * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    q = q.to(K.dtype.element_ty)
    first_pos = ctx - q_len + tile * BLOCK_M  # position of the tile's first query
    pos_q = first_pos + tl.arange(0, BLOCK_M)

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    table = BlockTables + seq * stride_bt
    # Keys below `free` are visible to every query of the tile; the rest up to `hi` straddle the diagonal. Two
    # calls on purpose: the tiles below the diagonal skip the mask (the two stages of Triton's fused attention).
    free = (first_pos // BLOCK_N) * BLOCK_N
    hi = tl.minimum(ctx, first_pos + BLOCK_M)
    acc, l_i, m = attend_paged(
        acc,
        l_i,
        m,
        q,
        pos_q,
        K,
        V,
        table,
        kv_head,
        0,
        free,
        scale_log2,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        HEAD_DIM,
        BLOCK_D,
        PAGE,
        BLOCK_N,
        "none",
        UPCAST,
        PRECISION,
    )
    acc, l_i, m = attend_paged(
        acc,
        l_i,
        m,
        q,
        pos_q,
        K,
        V,
        table,
        kv_head,
        free,
        hi,
        scale_log2,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        HEAD_DIM,
        BLOCK_D,
        PAGE,
        BLOCK_N,
        "causal",
        UPCAST,
        PRECISION,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + tokens[:, None] * stride_on + head * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=q_mask,
    )


# paged_prefill_attention's signature (kernels/reference.py) first, as each backend declares it, then knobs
def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    max_context_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> torch.Tensor:
    """query [N, H, D] (chunks back to back) -> [N, H, D]. max_context_len is accepted for the contract; the
    grid only needs max_q_len (computed with one device sync when not given)."""
    check_device(_prefill_kernel, query, k_cache, v_cache)
    num_tokens, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = k_cache.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if not max_q_len:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    query = query if query.stride(-1) == 1 else query.contiguous()
    block_d = head_block(head_dim)
    block_m = block_m or (64 if max_q_len > 16 else 16)
    block_n = block_n or (64 if block_d <= 128 else 32)
    num_warps = num_warps or (4 if block_d <= 64 else 8)
    grid = (num_heads, triton.cdiv(max_q_len, block_m), num_seqs)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        cu_seqlens_q,
        context_lens,
        block_tables,
        out,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        **dot_args(_prefill_kernel, k_cache.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
