"""store_kv: scatter this step's K/V rows into the paged cache through the slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmdeploy.kernels.triton_common import check_device


@triton.jit
def _store_kv_kernel(
    Key,
    Value,
    KCache,
    VCache,
    SlotMapping,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(SlotMapping + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block = slot // PAGE
    row = slot % PAGE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src = token.to(tl.int64)
    k = tl.load(Key + src * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(Value + src * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = KCache + block * stride_kcb + row * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = VCache + block * stride_vcb + row * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_dst, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(VCache.dtype.element_ty), mask=mask)


# The op contract's signature (kernels/reference.py), declared again by each backend that implements it
def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [N, Hkv, D] (any token/head strides, unit last stride) -> k_cache/v_cache at slot_mapping."""
    check_device(_store_kv_kernel, key, k_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    block_d = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=block_d,
        num_warps=4 if num_kv_heads * block_d >= 1024 else 1,
    )
