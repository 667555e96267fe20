"""The serving engine: paged KV cache, continuous batching, sampling (CONTRACTS.md section 3).

Exports load lazily so that the pure-Python parts (scheduler, block manager) import without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "LLM": "llmdeploy.engine.llm",
    "LLMEngine": "llmdeploy.engine.llm_engine",
    "AsyncLLMEngine": "llmdeploy.engine.async_engine",
    "EngineConfig": "llmdeploy.engine.config",
    "SamplingParams": "llmdeploy.engine.sampling_params",
    "RequestOutput": "llmdeploy.engine.outputs",
    "CompletionOutput": "llmdeploy.engine.outputs",
    "TokenLogprob": "llmdeploy.engine.outputs",
    "RequestMetrics": "llmdeploy.engine.outputs",
    "EngineStats": "llmdeploy.engine.outputs",
    "ContextLengthError": "llmdeploy.engine.errors",
    "ParamError": "llmdeploy.engine.errors",
    "CapacityError": "llmdeploy.engine.errors",
    "RequestFailedError": "llmdeploy.engine.errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'llmdeploy.engine' has no attribute {name!r}")
