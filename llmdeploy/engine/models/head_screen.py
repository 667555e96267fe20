"""The LM head's screen for greedy decode (kernels/csrc/head_screen.c): a Q8 copy of the head (exact Q8 weights times
float32 inputs) for a few rows and, for a float32 head where the CPU has bf16 products, a bf16 copy for more rows;
per vocabulary row, how far its screened logit can be from the exact one. The kernel then reads a copy and only the
head's tiles that may hold the largest exact logit, and answers the whole head's greedy token."""

from __future__ import annotations

import os

import torch

from llmdeploy.engine.models.quant import QUANTIZE_ROWS, BlockWeights, quantize_q8
from llmdeploy.kernels import cpu_native, native_quant
from llmdeploy.kernels.decode_step import HeadScreen
from llmdeploy.kernels.native_quant import Q_BLOCK, QFormat

ENV_SWITCH = "LLMDEPLOY_HEAD_SCREEN"  # =0: the whole head at every greedy step (the benchmarks' baseline)
# candidate tiles beyond this share of the head's: the screen declines and the whole head runs (a flat
# distribution; then reading candidates would cost about what it saves)
MAX_TILE_SHARE = 0.25
EPS32 = 2.0**-24  # float32's unit roundoff


def bound_coefficients(weight: torch.Tensor, screen: torch.Tensor) -> torch.Tensor:
    """Per row v of the head (weight, as the exact kernel multiplies it; float32) and of its Q8 copy (screen,
    dequantized): c_x1[v] such that |exact logit - screened logit| <= c_x1[v] sum |x| (head_screen.c says why): the
    row's largest weight error, and the float32 rounding of both sums (K products each, the Q8 one through per-block
    partial sums) on its largest weight. In float32 (a float64 pass took 0.95 s over SmolLM2's head), each rounding
    here covered by the margins."""
    k = weight.shape[1]
    error = (weight - screen).abs().amax(dim=1) * (1 + 2.0**-20)  # one rounding of the difference
    largest = screen.abs().amax(dim=1) + weight.abs().amax(dim=1)
    rounding = (2 * k + k // Q_BLOCK + 8) * EPS32 * largest
    return ((error + rounding) * (1 + 2.0**-18)).contiguous()


def l2_coefficients(weight: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """Per row v of a float32 head (weight) and its bf16 copy as the kernel reads it (rounded, float32 values):
    [A, B] [V, 2] such that |exact logit - screened logit| <= A |x|_2 + B |x - bf16(x)|_2 (head_screen.c says
    why): the row's weight error and both sums' float32 rounding (2 (K + 16) units each, on |w| and |w~|, with
    |x~| <= |x| + |x - x~| putting the second's share of it into B). The norms in float32 (sums of K squares: at
    most K units off), covered by the margin."""
    k = weight.shape[1]
    rounding = 2 * (k + 16) * EPS32
    error, norm, norm_rounded = (weight - rounded).norm(dim=1), weight.norm(dim=1), rounded.norm(dim=1)
    margin = 1 + 4 * k * EPS32 + 2.0**-16
    a = (error + rounding * (norm + norm_rounded)) * margin
    b = norm_rounded * (1 + rounding) * margin
    return torch.stack([a, b], dim=1).contiguous()


def bf16_rounded(weight: torch.Tensor) -> torch.Tensor:
    """float32 weights rounded to bf16 (to nearest even) with subnormals flushed, as vdpbf16ps reads them."""
    rounded = weight.to(torch.bfloat16)
    return torch.where(rounded.float().abs() < 2.0**-126, torch.zeros_like(rounded), rounded)


def build(weight: torch.Tensor) -> HeadScreen | None:
    """The screen of a head whose exact weights are `weight` [V, K] (float32 or bf16 values); None where it does
    not apply (switched off, no native kernels, K not whole blocks, a weight not finite). A float32 head on a CPU
    with AVX-512 BF16 also gets the bf16 copy (half its bytes again: 57 MB for SmolLM2's)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    vocab, k = weight.shape
    if k % Q_BLOCK:
        return None
    exact = weight.detach().float()
    blocks = quantize_q8(exact)
    # in row chunks, as quantize_q8 (quantizing and bounding SmolLM2's head at once: 0.72 s, in chunks 0.12 s, Zen 3)
    chunks = zip(
        exact.split(QUANTIZE_ROWS), blocks.q.split(QUANTIZE_ROWS), blocks.d.split(QUANTIZE_ROWS), strict=True
    )
    c_x1 = torch.cat(
        [
            bound_coefficients(rows, BlockWeights(QFormat.Q8, q, d, None, k).dequantize())
            for rows, q, d in chunks
        ]
    )
    if not torch.isfinite(c_x1).all():  # a weight not finite (its error is not either)
        return None
    packed = native_quant.q_pack(QFormat.Q8, blocks.q, blocks.d, None, vnni=False)
    if packed is None:
        return None
    max_tiles = int(-(-vocab // cpu_native.F32_TILE) * MAX_TILE_SHARE)
    bf16, c_l2 = None, None
    if weight.dtype == torch.float32 and cpu_native.avx512_bf16_available():
        rounded = bf16_rounded(exact)
        pairs = zip(exact.split(QUANTIZE_ROWS), rounded.split(QUANTIZE_ROWS), strict=True)
        c_l2 = torch.cat([l2_coefficients(rows, rows_rounded.float()) for rows, rows_rounded in pairs])
        # a weight past bf16's range rounds to infinity: no bound, no copy
        bf16, c_l2 = (cpu_native.bf16_pack(rounded), c_l2) if torch.isfinite(c_l2).all() else (None, None)
    return HeadScreen(packed.data, c_x1, max_tiles, bf16, c_l2)
