"""Memory a spec needs and the tokens its KV cache holds, from the model's config alone (no weights loaded).

`llmdeploy plan` shows it before anything starts; the engine measures the real figures at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmdeploy.policies import dtype_auto
from llmdeploy.spec.model_shape import ModelShape, ModelShapeError, read_model_shape
from llmdeploy.spec.models import DeploymentSpec
from llmdeploy.spec.sources import ModelSourceError, resolve_model_source

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# No native CPU kernel takes float16 and torch's float16 matmuls are slow on CPUs without AVX-512 FP16 (SmolLM2 on
# Zen 4, 2026-12-07: batch-1 decode 21.9 ms a token against float32's 8.9, TTFT(128) 736 against 165 ms)
FLOAT16_ON_CPU = (
    "model.dtype float16 on CPU: no native kernel takes it (torch's float16 matmuls: SmolLM2 decoded at 2.5x "
    "float32's time, prefilled at 4.5x); bfloat16 halves the bytes as well, and auto picks it where it pays"
)


class EstimateError(Exception):
    """The model's shape cannot be read; the message says why."""


@dataclass(frozen=True)
class Estimate:
    shape: ModelShape
    device: str  # cpu | cuda
    dtype: str
    weights_bytes: int
    kv_bytes_per_token: int
    kv_budget_bytes: int
    block_size: int
    max_model_len: int
    replicas: int
    notes: list[str] = field(default_factory=list)

    @property
    def kv_blocks(self) -> int:
        return self.kv_budget_bytes // (self.kv_bytes_per_token * self.block_size)

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    @property
    def max_model_len_seqs(self) -> int:
        """How many sequences of the full max_model_len fit in the KV cache at once."""
        return self.kv_tokens // self.max_model_len


def estimate(
    spec: DeploymentSpec,
    shape: ModelShape,
    device: str,
    gpu_total_bytes: int | None = None,
    cpu_bf16: str | None = None,
) -> Estimate:
    """Pure: the figures for one replica of `spec` serving a model of `shape` on `device` (cpu | cuda).
    `cpu_bf16`: the CPU's native bf16 matmul feature (avx512_bf16, amx_bf16), None when it has none."""
    notes: list[str] = []
    dtype = spec.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
        if device == "cpu" and spec.model.quantization != "none":
            notes.append(
                f"dtype auto with model.quantization {spec.model.quantization}: float32 activations (what the "
                "quantized kernels take)"
            )
        elif device == "cpu" and cpu_bf16 is None:
            notes.append(
                "dtype auto on this CPU: float32 (no native bf16 matmuls: avx512_bf16 or amx_bf16); model.dtype:"
                " bfloat16 halves weights and KV, and on AVX2 CPUs its widening kernel decodes small batches faster"
            )
        elif device == "cpu":
            notes.append(
                f"dtype auto on this CPU ({cpu_bf16}): bfloat16 if the engine measures it {dtype_auto.describe()}"
                " at start, else float32; counted as float32 here (bfloat16 halves weights and KV)"
            )
    if device == "cpu" and dtype == "float16":
        notes.append(FLOAT16_ON_CPU)
    dtype_bytes = DTYPE_BYTES[dtype]
    weights = (shape.num_params or 0) * dtype_bytes or shape.file_bytes
    if device == "cuda" and gpu_total_bytes:
        budget = max(0, int(gpu_total_bytes * spec.engine.gpu_memory_utilization) - weights)
        notes.append(
            f"KV budget on CUDA: gpu_memory_utilization {spec.engine.gpu_memory_utilization} x "
            f"{gpu_total_bytes / GiB:.1f} GiB minus weights, before activations"
        )
    else:
        budget = int(spec.engine.kv_cache_gb * GiB)
    est = Estimate(
        shape=shape,
        device=device,
        dtype=dtype,
        weights_bytes=weights,
        kv_bytes_per_token=shape.kv_bytes_per_token(dtype_bytes),
        kv_budget_bytes=budget,
        block_size=spec.engine.block_size,
        max_model_len=spec.model.max_model_len,
        replicas=spec.parallel.max_replicas,  # memory for the most that may run at once
        notes=notes,
    )
    if shape.max_position_embeddings and spec.model.max_model_len > shape.max_position_embeddings:
        notes.append(
            f"model.max_model_len {spec.model.max_model_len} exceeds the model's context "
            f"{shape.max_position_embeddings}; the engine will refuse it"
        )
    if est.max_model_len_seqs < 1:
        notes.append(
            f"the KV cache holds {est.kv_tokens} tokens, less than one sequence of max_model_len "
            f"{spec.model.max_model_len}; raise engine.kv_cache_gb or lower model.max_model_len"
        )
    return est


def resolve_device(spec: DeploymentSpec) -> tuple[str, int | None]:
    """(cpu | cuda, total GPU bytes or None); imports torch only when the spec leaves the device to us."""
    if spec.engine.device == "cpu":
        return "cpu", None
    import torch

    if not torch.cuda.is_available():
        if spec.engine.device == "cuda":
            raise EstimateError("engine.device is cuda but no CUDA device is available here")
        return "cpu", None
    return "cuda", torch.cuda.get_device_properties(0).total_memory


def estimate_spec(spec: DeploymentSpec) -> Estimate:
    """Read the model's shape (spec.model.path is absolute after load_spec_file) and estimate for this machine."""
    try:
        source = resolve_model_source(spec.model.path)
        shape = read_model_shape(source)
    except (ModelSourceError, ModelShapeError) as e:
        raise EstimateError(str(e)) from e
    from llmdeploy.engine.cpu_dtype import bf16_flag
    from llmdeploy.kernels.cpu_flags import cpu_flags

    device, gpu_total = resolve_device(spec)
    return estimate(spec, shape, device, gpu_total, bf16_flag(cpu_flags()))
