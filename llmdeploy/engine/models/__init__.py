"""Model registry: the `architectures` name in config.json -> the class that runs it on a paged KV cache."""

from __future__ import annotations

from torch import nn

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


def model_class(architectures: list[str] | None, model_type: str | None = None) -> type[nn.Module]:
    """config.json's `architectures` (or, without it, `model_type`) -> the class; a clear error otherwise."""
    names = list(architectures or [])
    if not names and model_type in MODEL_TYPES:
        names = [MODEL_TYPES[model_type]]
    for name in names:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    shown = ", ".join(repr(n) for n in names) or f"(none given; model_type {model_type!r})"
    raise UnsupportedModelError(
        f"architecture {shown} is not supported; supported: {', '.join(MODEL_REGISTRY)}"
    )
