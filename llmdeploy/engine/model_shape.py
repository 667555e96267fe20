"""ModelShape: the facts about a model that size its KV cache and bound its requests. Torch-free, so `llmdeploy
plan` reads them from the model's files without loading it (engine/estimate.py); the loader fills the same type
from the loaded model (engine/loader.py), adding what only the tokenizer knows."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    # the loaded model's is capped at a sliding window it uses (loader.max_positions_of); None: not in the files
    max_position_embeddings: int | None
    eos_token_ids: list[int] = field(
        default_factory=list
    )  # loader only: from the generation config or tokenizer
    num_params: int | None = None  # estimate only: summed from the tensor shapes in the weight files' headers
    file_bytes: int = 0  # estimate only: on disk; a quantized GGUF is smaller than its weights in memory

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes  # K and V, every layer
