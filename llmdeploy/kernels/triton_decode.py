"""Paged decode attention (one query token per sequence), flash-decoding style.

Grid (sequence, kv head, split). One program serves every query head of its KV group, so each K/V tile is read
from HBM once per group; the query heads are padded to a 16-row tile so the scores are a tensor-core tl.dot.
Tiles of BLOCK_N tokens are gathered through the block table token by token, so BLOCK_N is independent of the
cache's block size. With splits > 1 each split covers one partition of the context and writes a partial
(normalised output, log2-sum-exp); a second kernel merges the partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmdeploy.kernels.triton_common import attend_paged, check_device, dot_args, head_block, num_sms

LOG2E = 1.4426950408889634
MIN_PARTITION = 256  # tokens; shorter partitions cost more in partial writes and merging than they win
MAX_SPLITS = 32  # also the merge kernel's fixed split tile, so it compiles once per head_dim
WAVES = 4  # programs per SM we aim for before splitting stops paying


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, sms: int) -> int:
    """Split the context only while (sequence, kv head) programs alone would leave SMs idle: aim for WAVES
    programs per SM, never cut partitions below MIN_PARTITION tokens, cap at MAX_SPLITS. Small batches with
    long contexts split the most; batch 64 x 8 kv heads on a 132-SM H200 gives 2 splits at 2k context."""
    programs = max(1, batch * num_kv_heads)
    want = triton.cdiv(WAVES * sms, programs)
    most = max(1, triton.cdiv(max_context_len, MIN_PARTITION))
    return max(1, min(want, most, MAX_SPLITS))


@triton.jit
def _decode_kernel(
    Q,
    K,
    V,
    BlockTables,
    ContextLens,
    Out,
    PartOut,
    PartLse,
    scale_log2,
    partition_size,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ContextLens + seq)
    start = split * partition_size
    end = tl.minimum(start + partition_size, ctx)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q = q.to(K.dtype.element_ty)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = BlockTables + seq * stride_bt
    acc, l_i, m = attend_paged(
        acc,
        l_i,
        m,
        q,
        offs_h,  # no causal mask: the one query is the last position
        K,
        V,
        table,
        kv_head,
        start,
        end,
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
        "tail",
        UPCAST,
        PRECISION,
    )

    out_mask = h_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # An empty partition (start >= ctx) leaves l_i = 0; its lse of -inf gives it zero weight in the merge.
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        part = PartOut + seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
        tl.store(part, acc / safe_l[:, None], mask=out_mask)
        lse = tl.where(l_i > 0, m + tl.log2(safe_l), float("-inf"))
        tl.store(PartLse + seq * stride_lb + heads * stride_lh + split, lse, mask=h_mask)
    else:
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = Out + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o, (acc / safe_l[:, None]).to(Out.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_kernel(
    PartOut,
    PartLse,
    Out,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(PartLse + seq * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top > float("-inf"), top, 0.0))
    weight = weight / tl.maximum(tl.sum(weight, 0), 1e-30)
    part = PartOut + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :]
    parts = tl.load(part, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0)
    tl.store(Out + seq * stride_ob + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


# paged_attention_decode's signature (kernels/reference.py) first, as each backend declares it, then tuning knobs
def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """query [B, H, D] -> [B, H, D]. num_splits None = choose_num_splits; block_n/num_warps/num_stages are
    tuning knobs (bench/gpu_kernels.py sweeps them)."""
    check_device(_decode_kernel, query, k_cache, v_cache)
    batch, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    if not max_context_len:  # None or 0: not known to the caller
        max_context_len = int(context_lens.max())
    query = query if query.stride(-1) == 1 else query.contiguous()
    block_d = head_block(head_dim)
    block_n = block_n or (64 if block_d <= 128 else 32)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context_len, num_sms(query.device))
    num_splits = max(1, min(num_splits, triton.cdiv(max(max_context_len, 1), block_n)))
    partition = triton.cdiv(triton.cdiv(max(max_context_len, 1), num_splits), block_n) * block_n
    split = num_splits > 1
    if split:
        part_out = torch.empty(
            batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out, part_lse = out, out  # unused
    p_strides = part_out.stride()[:3] if split else (0, 0, 0)
    l_strides = part_lse.stride()[:2] if split else (0, 0)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        partition,
        query.stride(0),
        query.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *p_strides,
        *l_strides,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=head_block(group),
        BLOCK_D=block_d,
        PAGE=page,
        BLOCK_N=block_n,
        SPLIT=split,
        **dot_args(_decode_kernel, k_cache.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        _merge_kernel[(batch, num_heads)](
            part_out,
            part_lse,
            out,
            num_splits,
            *p_strides,
            *l_strides,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=max(MAX_SPLITS, triton.next_power_of_2(num_splits)),
        )
    return out
