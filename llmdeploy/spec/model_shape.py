"""ModelShape: the facts about a model that size its KV cache and bound its requests, and how to read them from
the model's files without loading it (config.json and safetensors headers, GGUF metadata). Torch-free, so the
YAML loader checks tensor parallelism against the heads and `llmdeploy plan` estimates memory without the
engine; the engine's loader fills the same type from the loaded model, adding what only the tokenizer knows."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmdeploy.spec.sources import ModelSource, safetensors_header, weight_files


class ModelShapeError(Exception):
    """The model's files do not say its shape (unreadable, or missing a field the estimate needs)."""


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


def read_model_shape(source: ModelSource) -> ModelShape:
    try:
        return read_gguf_shape(source.path) if source.kind == "gguf" else read_hf_shape(source.path)
    except ModelShapeError:
        raise
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise ModelShapeError(f"cannot read the shape of {source.display}: {e}") from e


def read_hf_shape(folder: Path) -> ModelShape:
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)  # multimodal configs nest the language model
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    files = weight_files(folder)
    return ModelShape(
        model_type=str(config.get("model_type", "?")),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        hidden_size=hidden,
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=config.get("max_position_embeddings"),
        num_params=sum(_safetensors_params(f) for f in files),
        file_bytes=sum(f.stat().st_size for f in files),
    )


def _safetensors_params(path: Path) -> int:
    """Element count from the file's header (sources.safetensors_header); no tensor data read."""
    tensors, _ = safetensors_header(path)
    return sum(math.prod(t["shape"]) for t in tensors.values())


def read_gguf_shape(path: Path) -> ModelShape:
    import gguf

    reader = gguf.GGUFReader(path)

    def get(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        if f is None:
            return default
        if hasattr(f, "contents"):
            return f.contents()
        return f.parts[f.data[0]].tolist()[0]  # gguf < 0.11

    arch = get("general.architecture")
    if arch is None:
        raise ModelShapeError(f"{path} has no general.architecture in its GGUF metadata")
    heads = int(get(f"{arch}.attention.head_count"))
    hidden = int(get(f"{arch}.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = get(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else 0)
    return ModelShape(
        model_type=str(arch),
        num_layers=int(get(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(get(f"{arch}.attention.key_length") or hidden // heads),
        hidden_size=hidden,
        vocab_size=int(vocab),
        max_position_embeddings=get(f"{arch}.context_length"),
        num_params=sum(math.prod(int(d) for d in t.shape) for t in reader.tensors),
        file_bytes=path.stat().st_size,
    )
