"""Building blocks shared by the model files: norms and the MLP activation call the kernel ops so the Triton
backend replaces them on CUDA; weights of fused projections are loaded shard by shard."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: ModuleType):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps, self.ops = eps, ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual) normalised; returns (normed, x + residual) for the next fused add."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


class MergedLinear(nn.Linear):
    """One matmul for several projections of the same input (q|k|v, gate|up); shard_sizes are row counts."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size

    def shard(self, param: torch.Tensor, shard_id: str) -> torch.Tensor:
        start, size = self.shard_offsets[shard_id]
        return param.data.narrow(0, start, size)
