"""RMSNorm with the fused residual add, and neox (half-split) rotary embedding: one program per token row.

Both round exactly where the reference does (the residual sum in the activation dtype, the normalised value
before the weight multiply), so bf16 results agree with kernels/reference.py to the last bit or one ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmdeploy.kernels.triton_common import check_device


@triton.jit
def _rms_norm_kernel(
    X,
    Residual,
    Weight,
    Out,
    NewResidual,
    eps,
    stride_xa,
    stride_xb,
    stride_ra,
    stride_rb,
    stride_oa,
    stride_ob,
    stride_na,
    stride_nb,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    a = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(X + a * stride_xa + b * stride_xb + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + a * stride_ra + b * stride_rb + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(NewResidual + a * stride_na + b * stride_nb + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    normed = (xf * inv).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + a * stride_oa + b * stride_ob + offs, (normed * w).to(Out.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., hidden] as [A, B, hidden] with a unit last stride, so [N, hidden] and per-head [N, H, D] views
    (Qwen3's q/k norm on slices of the fused projection) need no copy; copies only when no view exists."""
    t3 = t.reshape(-1, 1, t.shape[-1]) if t.dim() < 3 else t.reshape(-1, *t.shape[-2:])
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual) normalised -> (out, new residual); without a residual the new residual is x itself."""
    check_device(_rms_norm_kernel, x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else x
    if x.numel() == 0:
        return out, new_res
    x3 = _rows(x)
    r3 = _rows(residual) if residual is not None else x3
    n3 = _rows(new_res)
    o3 = _rows(out)
    hidden = x.shape[-1]
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[x3.shape[:2]](
        x3,
        r3,
        weight,
        o3,
        n3,
        eps,
        *x3.stride()[:2],
        *r3.stride()[:2],
        *o3.stride()[:2],
        *n3.stride()[:2],
        HIDDEN=hidden,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, new_res


@triton.jit
def _rotate_heads(
    Src,
    Dst,
    stride_h,
    stride_oh,
    offs,
    d_mask,
    cos,
    sin,
    HALF: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    """One token's heads (Src and Dst at its row) rotated by its cos and sin rows, float32 [1, BLOCK_HALF]."""
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    mask = (heads < NUM_HEADS) & d_mask[None, :]
    src = Src + heads * stride_h + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = Dst + heads * stride_oh + offs[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(Dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(Dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Positions,
    Q,
    K,
    CosSin,
    QOut,
    KOut,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_cs,
    stride_qon,
    stride_qoh,
    stride_kon,
    stride_koh,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    d_mask = offs < HALF
    cos = tl.load(CosSin + pos * stride_cs + offs, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(CosSin + pos * stride_cs + HALF + offs, mask=d_mask, other=0.0)[None, :]

    q_row, k_row = Q + token * stride_qn, K + token * stride_kn
    q_out, k_out = QOut + token * stride_qon, KOut + token * stride_kon
    _rotate_heads(q_row, q_out, stride_qh, stride_qoh, offs, d_mask, cos, sin, HALF, NUM_Q_HEADS, BLOCK_QH)
    _rotate_heads(k_row, k_out, stride_kh, stride_koh, offs, d_mask, cos, sin, HALF, NUM_K_HEADS, BLOCK_KH)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [N, H, D], key [N, Hkv, D] -> rotated copies (same dtypes); cos_sin_cache [max_pos, D] float32."""
    check_device(_rotary_kernel, query)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    q_out, k_out = (
        torch.empty_like(query, memory_format=torch.contiguous_format),
        torch.empty_like(key, memory_format=torch.contiguous_format),
    )
    if num_tokens == 0:
        return q_out, k_out
    query = query if query.stride(-1) == 1 else query.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    cos_sin_cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        q_out,
        k_out,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin_cache.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        NUM_Q_HEADS=num_heads,
        NUM_K_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_QH=triton.next_power_of_2(num_heads),
        BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return q_out, k_out
