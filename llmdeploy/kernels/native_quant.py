"""Block-quantized weights (GGUF Q8_0 / Q4_1 blocks; model.quantization int8) in the native kernels' layouts
(csrc/q_linear*.c, csrc/qv_linear_avx2.c, csrc/q_format.h), and their linear: None wherever no kernel applies."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

import torch

from llmdeploy.kernels import native_build
from llmdeploy.kernels.cpu_native import linear_rows, ptr
from llmdeploy.kernels.huge_pages import huge_empty


class QFormat(enum.IntEnum):
    """GGUF's block-quantized weight formats the native kernel reads (fmt in q_format.h)."""

    Q8 = 0  # w = d * q, q int8, one float16 d per block (GGUF Q8_0; model.quantization int8)
    Q4 = 1  # w = d * q + m, q in 0..15, float16 d and m per block (GGUF Q4_1; Q4_0 is m = -8 d)


Q_BLOCK, Q_TILE = 32, 32  # inputs per block (GGUF's QK), channels per packed tile (QB, Q_NR in q_format.h)


def q_packed_bytes(fmt: QFormat, n: int, k: int) -> int:
    per_block = 2 * 64 + Q_BLOCK * 16 if fmt == QFormat.Q4 else 64 + Q_BLOCK * 32
    return -(-n // Q_TILE) * (k // Q_BLOCK) * per_block


@dataclass(frozen=True)
class QPacked:
    """A block-quantized weight in one of the kernel's layouts: `vnni` = llmd_qv_* (int8 dot products, x rounded
    to int8 per block), else llmd_q_* (float32 products of the exact weights)."""

    data: torch.Tensor  # uint8
    fmt: QFormat
    vnni: bool
    out_features: int
    in_features: int


def q_vnni_available() -> bool:
    """Whether the VNNI layout's kernel runs here (AVX-512 VNNI, or AVX2's multiply-add pairs in the same integer
    sums and float steps, below qv_exact_min_rows rows); LLMDEPLOY_QUANT_VNNI=0 keeps the float32 kernel."""
    lib = native_build.library()
    return (
        os.environ.get("LLMDEPLOY_QUANT_VNNI", "1") != "0"
        and lib is not None
        and bool(lib.llmd_has_qv_linear())
    )


def qv_exact_min_rows() -> int:
    """Rows from which the VNNI layout's kernel takes x as float32 against the exact weights (the float layout's
    bits at as many rows) instead of rounding it to int8: prefill on AVX2, where int8 products are no faster once
    compute-bound; 0 = never (AVX-512 VNNI rounds every row)."""
    lib = native_build.library()
    return int(lib.llmd_qv_exact_min_rows()) if lib is not None else 0


def q_pack(
    fmt: QFormat, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, vnni: bool | None = None
) -> QPacked | None:
    """q [N, K] (int8; Q4: uint8 0..15), d and m [N, K / 32] float16 -> the kernel's byte layout (tiles of 32
    channels, per block their scales then their quants; `vnni`: default where it runs), or None where no kernel
    applies."""
    lib = native_build.library()
    n, k = q.shape
    if lib is None or k % Q_BLOCK or d.shape != (n, k // Q_BLOCK) or d.dtype != torch.float16:
        return None
    if fmt == QFormat.Q4 and (m is None or m.shape != d.shape or m.dtype != torch.float16):
        return None
    vnni = q_vnni_available() if vnni is None else vnni
    q, d = q.contiguous(), d.contiguous()
    m = m.contiguous() if m is not None else None
    data = huge_empty(q_packed_bytes(fmt, n, k), torch.uint8)
    rc = lib.llmd_q_pack(int(fmt), int(vnni), q.data_ptr(), d.data_ptr(), ptr(m), n, k, data.data_ptr())
    return QPacked(data, fmt, vnni, n, k) if rc == 0 else None


def q_unpack(packed: QPacked) -> torch.Tensor:
    """The packed weight as float32 [N, K], as a dequantizing loader computes it."""
    out = torch.empty(packed.out_features, packed.in_features)
    fmt, n, k = int(packed.fmt), packed.out_features, packed.in_features
    if (
        native_build.library().llmd_q_unpack(
            fmt, int(packed.vnni), packed.data.data_ptr(), n, k, out.data_ptr()
        )
        != 0
    ):
        raise ValueError(f"cannot unpack a {packed.fmt.name} weight of {n} x {k}")
    return out


# Rows from which the float kernel's layout runs as bf16 products of a once-dequantized tile (llmd_q_bf16_linear,
# AVX-512 BF16) instead of float32 ones of the exact weights: where the float32 kernel stops being bandwidth-bound.
# Zen 4, SmolLM2 int8 decode steps alternating in one process: 8 requests 18.1-21.1 ms from 8 rows, 16.4-18.6 from
# 12 (even at 10-12, the bf16 path ahead at 16: 28.5 vs 31.8 ms); it was 8.
Q_BF16_MIN_ROWS = 12


def q_linear(x: torch.Tensor, packed: QPacked, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x[..., K] float32 @ w[N, K]^T + bias (float32) -> [..., N] float32, w as q_pack made it; None if the kernel
    does not apply. VNNI layout: x rounded to int8 per block (llama.cpp's way); float layout: exact weights times
    float32 x below Q_BF16_MIN_ROWS rows, bf16-rounded weights and x (float32 sums) from there where the CPU has
    AVX-512 BF16."""
    lib = native_build.library()
    n, k = packed.out_features, packed.in_features
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
        return None
    rows = x.numel() // k if k else 0
    if packed.vnni:
        kernel = lib.llmd_qv_linear
    elif rows >= Q_BF16_MIN_ROWS and lib.llmd_has_avx512_bf16():
        kernel = lib.llmd_q_bf16_linear
    else:
        kernel = lib.llmd_q_linear
    return linear_rows(
        x,
        n,
        lambda rows, out: kernel(
            int(packed.fmt),
            rows.data_ptr(),
            rows.stride(0),
            packed.data.data_ptr(),
            ptr(bias),
            out.data_ptr(),
            rows.shape[0],
            n,
            k,
            native_build.threads(),
        ),
    )
