"""The CPU attention kernels over the paged KV cache, read in place (csrc/decode_attention.c,
csrc/prefill_attention*.c): None wherever they do not apply, so the caller keeps the torch path."""

from __future__ import annotations

import torch

from llmdeploy.kernels import native_build


# paged_attention_decode's signature (kernels/reference.py), declared again by each backend that implements it
def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """paged_attention_decode with K/V read in place from the cache; None where the kernel does not apply."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if (
        query.device.type != "cpu"
        or k_cache.dtype not in (torch.float32, torch.bfloat16)
        or v_cache.dtype != k_cache.dtype
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or head_dim % 8
        or num_heads % num_kv_heads
        or num_seqs == 0
    ):
        return None
    lib = native_build.library()
    if lib is None:
        return None
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    bf16io = query.dtype == k_cache.dtype == torch.bfloat16 and head_dim % 16 == 0
    q = query if query.dtype == torch.float32 or bf16io else query.float()
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    # bf16 in and out: the kernel widens q and rounds its output itself, as the native decode step calls it
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.bfloat16 if bf16io else torch.float32)
    cache = (k_cache.data_ptr(), v_cache.data_ptr())
    if bf16io:
        call, flag = lib.llmd_paged_decode_attention_bf16io, ()
    else:
        call, flag = lib.llmd_paged_decode_attention, (int(k_cache.dtype == torch.bfloat16),)
    rc = call(
        q.data_ptr(),
        q.stride(0),
        *cache,
        *flag,
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        k_cache.shape[1],
        scale,
        native_build.threads(),
    )
    if rc != 0:
        return None
    return out if out.dtype == query.dtype else out.to(query.dtype)


# the prefill attention kernels per cache dtype, first choice first, each with the probe saying whether this build
# has its instructions: bf16 (prefill_attention.c, AVX-512 BF16; else prefill_attention_f32.c widening it, AVX2 +
# FMA), float32 (prefill_attention_f32.c)
PREFILL_KERNELS = {
    torch.bfloat16: (
        ("llmd_paged_prefill_attention_bf16", "llmd_has_avx512_bf16"),
        ("llmd_paged_prefill_attention_bf16_avx2", "llmd_has_avx2"),
    ),
    torch.float32: (("llmd_paged_prefill_attention_f32", "llmd_has_avx2"),),
}


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor | None:
    """One sequence's prefill chunk, query [n, H, D] (the last n of context_len positions, their K/V stored) against
    its cache read in place, query and cache both bf16 or both float32; None where no kernel applies (another
    dtype, a CPU without the kernel's instructions, a head dim it does not take), so the caller keeps the torch
    path."""
    n, num_heads, head_dim = query.shape
    if (
        query.dtype not in PREFILL_KERNELS
        or query.device.type != "cpu"
        or k_cache.dtype != query.dtype
        or v_cache.dtype != query.dtype
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or not 0 < n <= context_len
    ):
        return None
    lib = native_build.library()
    kernels = [k for k, probe in PREFILL_KERNELS[query.dtype] if lib and getattr(lib, probe)()]
    if not kernels:  # not on this CPU: no allocation per sequence and layer
        return None
    q = query if query.stride(2) == 1 and query.stride(1) == head_dim else query.contiguous()
    table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    table = table.contiguous()
    out = torch.empty(n, num_heads, head_dim, dtype=query.dtype)
    args = (
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        table.data_ptr(),
        k_cache.shape[1],
    )
    for kernel in kernels:  # the next where one declines the shape (AVX-512 BF16's takes head dims of 64s)
        rc = getattr(lib, kernel)(
            *args,
            n,
            context_len,
            out.data_ptr(),
            num_heads,
            k_cache.shape[2],
            head_dim,
            scale,
            native_build.threads(),
        )
        if rc == 0:
            return out
    return None
