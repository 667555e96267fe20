"""The LM head's screen for greedy decode at a few rows (kernels/csrc/head_screen.c): a Q8 copy of the head (exact
Q8 weights times float32 inputs) and, per vocabulary row, how far its screened logit can be from the exact one. The
kernel then reads the Q8 copy and only the head's tiles that may hold the largest exact logit, and answers the whole
head's greedy token."""

from __future__ import annotations

import os

import torch

from llmdeploy.engine.models.quant import quantize_q8
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


def build(weight: torch.Tensor) -> HeadScreen | None:
    """The screen of a head whose exact weights are `weight` [V, K] (float32 or bf16 values); None where it does
    not apply (switched off, no native kernels, K not whole blocks, a weight not finite)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    vocab, k = weight.shape
    if k % Q_BLOCK:
        return None
    exact = weight.detach().float()
    blocks = quantize_q8(exact)
    c_x1 = bound_coefficients(exact, blocks.dequantize())
    if not torch.isfinite(c_x1).all():  # a weight not finite (its error is not either)
        return None
    packed = native_quant.q_pack(QFormat.Q8, blocks.q, blocks.d, None, vnni=False)
    if packed is None:
        return None
    return HeadScreen(packed.data, c_x1, int(-(-vocab // cpu_native.F32_TILE) * MAX_TILE_SHARE))
