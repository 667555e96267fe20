"""Launch helpers shared by the Triton kernels: interpreter detection, dot precision, device facts."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


def interpreting(kernel: object) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (decided at import, not per call)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_device(kernel: object, *tensors: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors; the interpreter runs on CPU ones. Say which is missing."""
    if interpreting(kernel):
        return
    for t in tensors:
        if t.device.type != "cuda":
            raise RuntimeError(
                f"triton kernels need CUDA tensors (got {t.device}); run on a GPU, use kernel_backend='torch', "
                "or set TRITON_INTERPRET=1 before importing llmdeploy.kernels.triton_ops to run them on CPU"
            )


def dot_args(kernel: object, dtype: torch.dtype) -> dict:
    """Constexprs for tl.dot: fp32 inputs use exact (ieee) products, not tf32, so fp32 matches the reference;
    the interpreter's bf16/fp16 matmul is wrong, so there the operands are upcast to fp32 first."""
    upcast = interpreting(kernel) and dtype in (torch.bfloat16, torch.float16)
    return {"UPCAST": upcast, "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def head_block(n: int) -> int:
    """Register tile for a head-dim (or head-count) axis: a power of two, at least 16 for tl.dot."""
    return max(16, triton.next_power_of_2(n))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; a small stand-in on CPU (the interpreter) so heuristics still split."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


# Deliberately long call sites: a Triton jit helper takes scalars, pointers and constexprs, never a struct, so
# each caller (decode once, prefill twice) spells the same argument list out.
@triton.jit
def attend_paged(
    acc,
    l_i,
    m,
    q,
    pos_q,
    K,
    V,
    table,
    kv_head,
    lo,
    hi,
    scale_log2,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Online softmax of the rows of q (pre-scaled by log2 e: exp2) over keys lo..hi of one kv head, read tile by
    tile through the block table; carries (acc, l_i, m) across calls. MASK: "none" (every key of every tile is
    visible), "tail" (keys at or past hi are hidden) or "causal" (also keys after each row's position pos_q)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        block = tl.load(table + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        row = offs_n % PAGE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            K + (block * stride_kb + row * stride_kt + kv_head * stride_kh)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = dot(q, tl.trans(k), UPCAST, PRECISION) * scale_log2
        if MASK == "causal":
            s = tl.where((offs_n[None, :] <= pos_q[:, None]) & n_mask[None, :], s, float("-inf"))
        elif MASK == "tail":
            s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + (block * stride_vb + row * stride_vt + kv_head * stride_vh)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST, PRECISION)
        m = m_new
    return acc, l_i, m
