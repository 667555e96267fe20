"""EngineConfig: field names are the YAML's model.* and engine.* keys (llmdeploy/spec/models.py).

Built once (from the spec, the engine's command line or LLM(...)'s keywords) and handed down whole to LLMEngine,
ModelRunner and Scheduler, which read what they need from it; frozen, so every part sees the same settings (the
engine's copy has max_model_len capped by the model's positions)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from llmdeploy.spec.models import DeploymentSpec, EngineSpec, SLASpec

ENGINE_KEYS = tuple(EngineSpec.model_fields)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    max_model_len: int = 2048
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.9
    prefix_caching: bool = True
    device: str = "auto"
    kernel_backend: str = "auto"
    seed: int = 0
    compile: bool = False  # engine.compile: torch.compile of the decoder layers on CPU
    base_dir: str | None = None  # relative model paths resolve against it (the YAML file's folder)
    quantization: str = "none"  # model.quantization: none | int8 | gguf (weight-only, CPU)
    # sla.ttft_p99_ms: the scheduler's first-token deadlines count from it (llmdeploy/policies/deadline.py)
    ttft_sla_ms: float = SLASpec.model_fields["ttft_p99_ms"].default
    tensor_parallel: int = 1  # parallel.tensor_parallel: ranks of this engine (engine/parallel/)
    # decode steps (greedy or plain sampled) one native call may run on CPU (policies/decode_burst.py); 1 = off
    decode_burst: int = 4

    def __post_init__(self) -> None:
        # same rules as the YAML, so a config built in code fails the same way a spec would
        EngineSpec(**{k: getattr(self, k) for k in ENGINE_KEYS})
        assert self.max_model_len >= 1, "max_model_len must be >= 1"
        assert self.dtype in ("auto", "float32", "bfloat16", "float16"), f"unknown dtype {self.dtype}"
        assert self.quantization in ("none", "int8", "gguf"), f"unknown quantization {self.quantization}"
        assert self.ttft_sla_ms > 0, "ttft_sla_ms must be > 0"
        assert self.tensor_parallel >= 1, "tensor_parallel must be >= 1"
        assert self.decode_burst >= 1, "decode_burst must be >= 1"

    @property
    def ttft_sla_s(self) -> float:
        return self.ttft_sla_ms / 1e3

    @classmethod
    def from_spec(cls, spec: DeploymentSpec, base_dir: str | None = None, **overrides: Any) -> EngineConfig:
        kw: dict[str, Any] = dict(
            model=spec.model.path,
            dtype=spec.model.dtype,
            max_model_len=spec.model.max_model_len,
            quantization=spec.model.quantization,
            ttft_sla_ms=spec.sla.ttft_p99_ms,
            tensor_parallel=spec.parallel.tensor_parallel,
        )
        kw.update({k: getattr(spec.engine, k) for k in ENGINE_KEYS})
        kw.update(base_dir=base_dir, **overrides)
        return cls(**kw)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> tuple[EngineConfig, dict[str, Any]]:
        """Split kwargs into EngineConfig fields and the rest (nano-vllm style filtering by fields())."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in kwargs.items() if k in names}), {
            k: v for k, v in kwargs.items() if k not in names
        }
