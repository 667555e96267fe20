"""The compiled CPU kernels' linears (float32 and bfloat16 over packed weights) and row ops (add + RMSNorm, silu *
up, rotary + KV store, argmax) behind plain Python functions, with None as the answer wherever they do not apply,
so callers keep their torch path. The library itself (build, load, settings): native_build.py; attention:
native_attention.py; block-quantized weights: native_quant.py.
"""

from __future__ import annotations

import ctypes
import os

import torch

from llmdeploy.kernels import native_build
from llmdeploy.kernels.huge_pages import huge_empty


def linear_rows(x: torch.Tensor, n: int, kernel) -> torch.Tensor | None:
    """x[..., K] as rows with unit stride -> out [..., n] of x's dtype from kernel(rows, out) (0 on success)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype)
    if rows.shape[0] and kernel(rows, out) != 0:
        return None
    return out.view(*x.shape[:-1], n)


def ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


F32_TILE = 32  # output channels per packed tile (F32_NR in linear_avx512.c)


def _native_linear_runs(probe: str) -> bool:
    """The library is built with the instructions `probe` reports, and LLMDEPLOY_NATIVE_LINEAR=0 (keep oneDNN's
    GEMM: the benchmarks' baseline) is not set."""
    if os.environ.get("LLMDEPLOY_NATIVE_LINEAR", "1") == "0":
        return False
    lib = native_build.library()
    return lib is not None and bool(getattr(lib, probe)())


def f32_linear_available() -> bool:
    """Whether the native float32 linear runs here (AVX-512, or AVX2 + FMA; elsewhere oneDNN's packed GEMM stays)."""
    return _native_linear_runs("llmd_has_f32_linear")


def f32_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """float32 [N, K] -> the native linear's layout (tiles of F32_TILE channels, k-major), or None."""
    if not f32_linear_available() or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    n, k = weight.shape
    w = weight.detach().contiguous()
    packed = huge_empty(-(-n // F32_TILE) * F32_TILE * k, torch.float32)
    return (
        packed
        if native_build.library().llmd_f32_pack(w.data_ptr(), n, k, packed.data_ptr(), native_build.threads())
        == 0
        else None
    )


def _packed_linear(
    kernel: str, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor | None:
    """x[..., K] @ weight[n, K]^T + bias through `kernel` (llmd_f32_linear or llmd_bf16_linear), everything in
    packed's dtype; None if it does not apply."""
    lib = native_build.library()
    k = x.shape[-1]
    if lib is None or x.dtype != packed.dtype or x.device.type != "cpu" or packed.numel() % k:
        return None
    if bias is not None and bias.dtype != packed.dtype:
        return None
    return linear_rows(
        x,
        n,
        lambda rows, out: getattr(lib, kernel)(
            rows.data_ptr(),
            rows.stride(0),
            packed.data_ptr(),
            ptr(bias),
            out.data_ptr(),
            rows.shape[0],
            n,
            k,
            native_build.threads(),
        ),
    )


def f32_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor | None:
    """x[..., K] float32 @ weight[n, K]^T + bias, the weight as f32_pack made it; None if it does not apply."""
    return _packed_linear("llmd_f32_linear", x, packed, bias, n)


def bf16_linear_available() -> bool:
    """Whether the native bfloat16 linear runs here: AVX-512 BF16's vdpbf16ps, or AVX2 + FMA widening each weight
    to float32 with vdpbf16ps's arithmetic (csrc/bf16_linear_avx2.c)."""
    return _native_linear_runs("llmd_has_bf16_linear")


def avx512_bf16_available() -> bool:
    """Whether the kernels built here have AVX-512 BF16's instructions (the bf16 prefill attention, the many-row
    block-quantized linear's bf16 products, AMX's neighbour)."""
    lib = native_build.library()
    return lib is not None and bool(lib.llmd_has_avx512_bf16())


def bf16_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """bfloat16 [N, K] (K even) -> the native bf16 linear's layout (tiles of F32_TILE channels, input pairs), or
    None."""
    if (
        not bf16_linear_available()
        or weight.dtype != torch.bfloat16
        or weight.dim() != 2
        or weight.shape[1] % 2
    ):
        return None
    n, k = weight.shape
    w = weight.detach().contiguous()
    packed = huge_empty(-(-n // F32_TILE) * F32_TILE * k, torch.bfloat16)
    return (
        packed
        if native_build.library().llmd_bf16_pack(
            w.data_ptr(), n, k, packed.data_ptr(), native_build.threads()
        )
        == 0
        else None
    )


def bf16_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor | None:
    """x[..., K] bfloat16 @ weight[n, K]^T + bias -> bfloat16 (float32 sums, one rounding), the weight as
    bf16_pack made it; None if it does not apply (odd K among them)."""
    if x.shape[-1] % 2:
        return None
    return _packed_linear("llmd_bf16_linear", x, packed, bias, n)


def native_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in its dtype's native linear layout (f32_pack, bf16_pack), or None where none applies."""
    return bf16_pack(weight) if weight.dtype == torch.bfloat16 else f32_pack(weight)


def native_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor | None:
    """f32_linear or bf16_linear by the packed weight's dtype; None if it does not apply."""
    return (bf16_linear if packed.dtype == torch.bfloat16 else f32_linear)(x, packed, bias, n)


ROW_DTYPES = (torch.float32, torch.bfloat16)  # what the norm and rotary kernels take (bf16: `_bf16` variants)


def _rows_of(dtype: torch.dtype, *tensors: torch.Tensor | None) -> bool:
    """All CPU tensors of `dtype` (float32 or bfloat16), rows contiguous, outside torch.compile."""
    if torch.compiler.is_compiling() or dtype not in ROW_DTYPES:
        return False
    return all(
        t is None or (t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()) for t in tensors
    )


def _variant(lib: ctypes.CDLL, name: str, dtype: torch.dtype):
    return getattr(lib, name + "_bf16" if dtype == torch.bfloat16 else name)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + residual) normalised times weight, and x + residual, in one pass; None if not applicable."""
    dim = x.shape[-1]
    if (
        dim % 8
        or not _rows_of(x.dtype, x, weight, residual)
        or weight.shape != (dim,)
        or (residual is not None and residual.shape != x.shape)
    ):
        return None
    lib = native_build.library()
    if lib is None:
        return None
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    rc = _variant(lib, "llmd_add_rms_norm", x.dtype)(
        x.data_ptr(),
        residual.data_ptr() if residual is not None else None,
        weight.data_ptr(),
        out.data_ptr(),
        summed.data_ptr(),
        x.numel() // dim,
        dim,
        eps,
        native_build.threads(),
    )
    return (out, summed) if rc == 0 else None


def _logit_rows(logits: torch.Tensor) -> bool:
    """float32 [rows, n > 0] on CPU, each row contiguous, outside torch.compile: what the sampling kernels read."""
    return (
        logits.dim() == 2
        and logits.dtype == torch.float32
        and logits.device.type == "cpu"
        and logits.stride(1) == 1
        and logits.shape[1] > 0
        and not torch.compiler.is_compiling()
    )


def argmax_rows(logits: torch.Tensor) -> list[int] | None:
    """logits.argmax(-1).tolist() for float32 [rows, n] on CPU (first index of the largest; NaN largest), or None
    where it does not apply."""
    if not _logit_rows(logits):
        return None
    lib = native_build.library()
    if lib is None:
        return None
    rows = logits.shape[0]
    out = (ctypes.c_int64 * rows)()
    rc = lib.llmd_argmax_rows(
        logits.data_ptr(), rows, logits.shape[1], logits.stride(0), out, native_build.threads()
    )
    return list(out) if rc == 0 else None


def sample_rows(
    logits: torch.Tensor, inv_temp: list[float], min_p: list[float], u: list[float]
) -> list[int] | None:
    """One token per float32 [rows, n] logit row from softmax(logits / T) with min_p, by inverse CDF in token order
    with the uniform u (kernels/csrc/sample_rows.c), or None where it does not apply (or a row has no finite
    logit: the caller's torch ops answer that)."""
    rows = logits.shape[0] if logits.dim() == 2 else 0
    if not _logit_rows(logits) or not len(inv_temp) == len(min_p) == len(u) == rows:
        return None
    lib = native_build.library()
    if lib is None:
        return None
    out = (ctypes.c_int64 * rows)()
    rc = lib.llmd_sample_rows(
        logits.data_ptr(),
        rows,
        logits.shape[1],
        logits.stride(0),
        (ctypes.c_float * rows)(*inv_temp),
        (ctypes.c_float * rows)(*min_p),
        (ctypes.c_double * rows)(*u),
        out,
        native_build.threads(),
    )
    tokens = list(out)
    return tokens if rc == 0 and min(tokens, default=0) >= 0 else None


def kernel_top_k(top_k: list[int]) -> list[int]:
    """top_k as llmd_top_k_top_p_rows takes it (int64; <= 0 or >= the vocabulary: none): past int64 is none too."""
    return [k if 0 < k < 2**62 else 0 for k in top_k]


def float32_top_p(top_p: list[float]) -> list[float]:
    """top_p as the sort definition compares it (a float32 tensor; engine/sampling_filters.py), capped at 1."""
    return torch.tensor([min(p, 1.0) for p in top_p], dtype=torch.float32).tolist()


def top_k_top_p_rows(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], inv_temp: list[float] | None = None
) -> torch.Tensor | None:
    """A copy of float32 [rows, n] logits with each row's top_k (<= 0 or >= n: none) and top_p (1: none) applied
    as engine/sampling_filters.py's top_k_top_p_by_sort defines them over softmax(logits * inv_temp) (default 1;
    0: a greedy row, untouched), dropped logits -inf (kernels/csrc/sample_rows.c); None where the kernel does not
    apply."""
    rows = logits.shape[0] if logits.dim() == 2 else 0
    inv_temp = [1.0] * rows if inv_temp is None else inv_temp
    if not _logit_rows(logits) or not len(top_k) == len(top_p) == len(inv_temp) == rows:
        return None
    lib = native_build.library()
    if lib is None:
        return None
    out = logits.contiguous().clone()
    rc = lib.llmd_top_k_top_p_rows(
        out.data_ptr(),
        rows,
        out.shape[1],
        out.stride(0),
        (ctypes.c_int64 * rows)(*kernel_top_k(top_k)),
        (ctypes.c_double * rows)(*float32_top_p(top_p)),
        (ctypes.c_float * rows)(*inv_temp),
        native_build.threads(),
    )
    return out if rc == 0 else None


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """x = [gate | up] along the last dim -> silu(gate) * up; None if not applicable."""
    inter = x.shape[-1] // 2
    if inter % 8 or not _rows_of(x.dtype, x):
        return None
    lib = native_build.library()
    # bf16 on 8 lanes (AVX2): torch's two vectorised ops were faster
    if lib is None or (x.dtype == torch.bfloat16 and not lib.llmd_has_avx512()):
        return None
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype)
    rc = _variant(lib, "llmd_silu_mul", x.dtype)(
        x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], inter, native_build.threads()
    )
    return out if rc == 0 else None


def rope_and_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> bool:
    """Rotates q and k in place in the fused qkv rows [N, H + 2 Hkv, D] by this step's cos/sin ([N, 1, D],
    reference.rotary_tables) and stores k, v into the caches at slot_mapping (-1: skipped). False (nothing done)
    where it does not apply; the caller then runs the torch ops."""
    n = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    if (
        head_dim % 16
        or qkv.shape[1:] != (num_heads + 2 * num_kv_heads, head_dim)
        or cos.shape != (n, 1, head_dim)
        or not _rows_of(qkv.dtype, qkv, k_cache, v_cache)
        or not _rows_of(torch.float32, cos, sin)
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
    ):
        return False
    lib = native_build.library()
    if lib is None:
        return False
    rc = _variant(lib, "llmd_rope_store", qkv.dtype)(
        qkv.data_ptr(),
        n,
        num_heads,
        num_kv_heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        slot_mapping.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        native_build.threads(),
    )
    return rc == 0
