"""Weight-only quantized projections (CPU) in GGUF's block formats, read by the native kernel without a float copy:
`model.quantization: int8` quantizes the loaded weights to Q8 blocks; `gguf` keeps a GGUF file's own Q8_0 / Q4_0 /
Q4_1 blocks (engine/gguf_blocks.py). Computes in float32; output in the input's dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmdeploy.kernels import native_quant
from llmdeploy.kernels.decode_step import LinearKind, NativeLinear
from llmdeploy.kernels.native_quant import Q_BLOCK, QFormat

FP16_MAX = 65504.0


@dataclass(frozen=True)
class BlockWeights:
    """One projection's weight [N, K] in blocks of Q_BLOCK inputs: w = d * q (Q8) or d * q + m (Q4). K is padded
    with zero weights to whole blocks (in_features keeps the real K)."""

    fmt: QFormat
    q: torch.Tensor  # [N, K padded] int8 (Q8) or uint8 in 0..15 (Q4)
    d: torch.Tensor  # [N, K padded / Q_BLOCK] float16
    m: torch.Tensor | None  # like d (Q4), else None
    in_features: int

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: d * q is exact in float32 and Q4 adds m in one rounding, as a dequantizing loader does."""
        n = self.out_features
        w = self.q.float().view(n, -1, Q_BLOCK) * self.d.float()[..., None]
        if self.m is not None:
            w = w + self.m.float()[..., None]
        return w.view(n, -1)[:, : self.in_features]

    def rows(self, index: torch.Tensor) -> BlockWeights:
        """The output channels at `index`, in that order (blocks run along K, so rows move whole)."""
        m = None if self.m is None else self.m[index]
        return BlockWeights(self.fmt, self.q[index], self.d[index], m, self.in_features)


def concat_rows(parts: list[BlockWeights]) -> BlockWeights | None:
    """Fused projections (q|k|v, gate|up) as one weight; None when the parts' formats or widths differ."""
    first = parts[0]
    if any(p.fmt != first.fmt or p.in_features != first.in_features for p in parts):
        return None
    m = None if first.m is None else torch.cat([p.m for p in parts])
    return BlockWeights(
        first.fmt,
        torch.cat([p.q for p in parts]),
        torch.cat([p.d for p in parts]),
        m,
        first.in_features,
    )


# rows quantized at a time: each op's temporaries stay in cache and in the allocator's reused memory (a whole LM
# head at once made several 113 MB temporaries, each a fresh mapping whose page faults cost more than the arithmetic)
QUANTIZE_ROWS = 2048


def quantize_q8(weight: torch.Tensor) -> BlockWeights:
    """Symmetric int8 per block of 32 inputs (GGUF's Q8_0): d = amax / 127 in float16, q = round(w / d). Row by
    row, so it runs QUANTIZE_ROWS at a time with the same result."""
    if weight.shape[0] > QUANTIZE_ROWS:
        parts = [_quantize_q8(rows) for rows in weight.split(QUANTIZE_ROWS)]
        q, d = torch.cat([b.q for b in parts]), torch.cat([b.d for b in parts])
        return BlockWeights(QFormat.Q8, q, d, None, weight.shape[1])
    return _quantize_q8(weight)


def _quantize_q8(weight: torch.Tensor) -> BlockWeights:
    w = weight.detach().float()
    n, k = w.shape
    w = F.pad(w, (0, -k % Q_BLOCK)).view(n, -1, Q_BLOCK)
    d = (w.abs().amax(dim=-1) / 127.0).clamp_(max=FP16_MAX).half()
    step = d.float()[..., None]
    q = torch.where(step > 0, torch.round(w / step.clamp_min(torch.finfo(torch.float32).tiny)), 0.0)
    q = q.clamp_(-127, 127).to(torch.int8).view(n, -1)
    return BlockWeights(QFormat.Q8, q.contiguous(), d.contiguous(), None, k)


class QuantLinear(nn.Module):
    """A linear layer whose weight stays block-quantized (Q8: ~8.5 bits a weight, Q4: 5-6), so bandwidth-bound
    decode reads a quarter to a sixth of float32's bytes."""

    def __init__(self, blocks: BlockWeights, bias: torch.Tensor | None, int8_inputs: bool = True):
        """int8_inputs: the VNNI kernel where the CPU has it (each layer's input rounded to int8 per block, as
        llama.cpp does); False: weight-only, inputs stay float32 (bf16 at many rows: native_quant.q_linear)."""
        super().__init__()
        self.fmt = blocks.fmt
        self.out_features, self.in_features = blocks.out_features, blocks.in_features
        self.padded_in = blocks.q.shape[1]
        vnni = None if int8_inputs else False
        self.packed = native_quant.q_pack(
            blocks.fmt, blocks.q, blocks.d, blocks.m, vnni
        )  # None without the kernel
        # once packed, the blocks' own tensors go: the packed bytes are the only copy of the weight
        self.blocks = blocks if self.packed is None else None
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x if x.dtype == torch.float32 else x.float()
        out = None
        # the kernel at every row count: with VNNI it is on par with the bf16 GEMM at 512-2048 rows and 2.4x the
        # float32 one; without, still ahead of a dequantized copy per call (bench/RESULTS.md)
        if self.packed is not None:
            xk = (
                xf
                if self.padded_in == self.in_features
                else F.pad(xf, (0, self.padded_in - self.in_features))
            )
            out = native_quant.q_linear(xk, self.packed, self.bias)
        if out is None:
            out = F.linear(xf, self.weight, self.bias)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def native_linear(self) -> NativeLinear | None:
        """This layer for the native decode step (kernels/decode_step.py): float32 activations, unpadded rows."""
        if self.packed is None or self.padded_in != self.in_features:
            return None
        kind = LinearKind.QV if self.packed.vnni else LinearKind.Q
        return NativeLinear(
            kind, self.packed.data, self.bias, self.out_features, self.in_features, int(self.fmt)
        )

    @property
    def weight(self) -> torch.Tensor:
        """Dequantized float32 [N, K]: the path without the native kernel, and inspection."""
        if self.blocks is not None:
            return self.blocks.dequantize()
        return native_quant.q_unpack(self.packed)[:, : self.in_features]


def quantize_linears(model: nn.Module) -> None:
    """Replaces every nn.Linear of `model` by a weight-only Q8 QuantLinear (a head tied to the embedding gets its
    own copy; the embedding stays as it is: it is read one row per token). Weight-only: rounding every layer's
    input to int8 as well (the VNNI kernel) took SmolLM2's first-16-token greedy agreement with float32 from 9/10
    to 5/10 prompts, and bought no decode speed (bandwidth-bound either way)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, QuantLinear(quantize_q8(child.weight), child.bias, int8_inputs=False))
