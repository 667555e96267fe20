"""Model registry: the `architectures` name in config.json -> the class that runs it on a paged KV cache."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from llmdeploy.engine.errors import EngineError
from llmdeploy.engine.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


# configs without `architectures` (hand-written ones) fall back to model_type
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class UnsupportedModelError(EngineError, ValueError):
    pass


def model_class(config: PretrainedConfig) -> type[nn.Module]:
    names = getattr(config, "architectures", None) or []
    if not names and getattr(config, "model_type", None) in MODEL_TYPES:
        names = [MODEL_TYPES[config.model_type]]
    for name in names:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    shown = ", ".join(repr(n) for n in names) or f"(none; model_type {getattr(config, 'model_type', None)!r})"
    raise UnsupportedModelError(
        f"architecture {shown} is not supported; supported: {', '.join(MODEL_REGISTRY)}"
    )
