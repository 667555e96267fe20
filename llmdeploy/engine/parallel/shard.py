"""Which part of each weight a rank holds, read straight from the checkpoint's slice (no full tensor first)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

# column: the output rows are split (q/k/v, gate/up: whole heads or a block of the MLP per rank);
# row: the input columns are split (o, down: each rank's part is summed across ranks afterwards)
Split = Literal["column", "row"]


class ShardError(ValueError):
    """The model cannot be split across these ranks; the message says which sizes do not divide."""


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1

    def part(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, rows); the split must be even."""
        if total % self.size:
            raise ShardError(
                f"tensor_parallel {self.size} does not divide the model's {total} {what}; each rank needs an "
                "equal share"
            )
        return total // self.size


def check_split(config: Any, size: int) -> None:
    """Raises ShardError unless `size` ranks can split this model (a transformers config) into equal parts."""
    shard = Shard(0, size)
    shard.part(config.num_attention_heads, "attention heads")
    shard.part(getattr(config, "num_key_value_heads", None) or config.num_attention_heads, "KV heads")
    shard.part(config.intermediate_size, "MLP rows (intermediate_size)")


def shard_picker(shard: Shard, split_of: Callable[[str], Split | None]) -> Callable[[str, Any], torch.Tensor]:
    """(checkpoint name, safetensors slice) -> this rank's tensor. A row-split layer's bias is added once, after
    the sum across ranks would have added it N times: rank 0 keeps it, the others hold zeros."""

    def pick(name: str, sliced: Any) -> torch.Tensor:
        split = split_of(name)
        if split is None:
            return sliced[:]
        shape = sliced.get_shape()
        if split == "column":
            n = shard.part(shape[0], f"rows of {name}")
            return sliced[shard.rank * n : (shard.rank + 1) * n]
        if len(shape) == 1:  # a row-split layer's bias
            bias = sliced[:]
            return bias if shard.rank == 0 else torch.zeros_like(bias)
        n = shard.part(shape[1], f"columns of {name}")
        return sliced[:, shard.rank * n : (shard.rank + 1) * n]

    return pick
