"""load_model: a model source (HF folder, .gguf file, builtin) -> our model with its weights, tokenizer and shape
facts (CONTRACTS.md section 2)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from llmdeploy.engine.cpu_dtype import choose_cpu_dtype
from llmdeploy.engine.estimate import FLOAT16_ON_CPU
from llmdeploy.engine.gguf_blocks import read_block_weights
from llmdeploy.engine.model_config import read_model_config
from llmdeploy.engine.models import model_class
from llmdeploy.engine.models.layers import packed_linear_available
from llmdeploy.engine.models.llama import head_dim_of
from llmdeploy.engine.parallel.shard import Shard, shard_picker
from llmdeploy.engine.rope import rope_inv_freq
from llmdeploy.engine.weights_cache import cache_root, ensure_converted
from llmdeploy.kernels import resolve_backend
from llmdeploy.spec.model_shape import ModelShape
from llmdeploy.spec.sources import ModelSource, resolve_model_source, weight_files

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What "auto" means per device when the model's shape is not known; with it, a CPU with native bf16 matmuls that
# are measured faster gets bfloat16 (engine/cpu_dtype.py), unless the weights are quantized: the quantized kernels
# and the native decode step around them take float32 activations, and bf16 ones ran the Python layers instead
# (SmolLM2 int8, Zen 4, 2026-12-07, one process: batch-1 decode 10.0 ms a token against float32's 4.25).
AUTO_DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}
COMPILE_BY_DEFAULT = False
# model.quantization (weight-only, CPU): int8 = the loaded weights quantized to Q8 blocks; gguf = a GGUF file's own
# Q8_0 / Q4_0 / Q4_1 blocks kept as they are (other tensor types dequantized as for none)
QUANTIZATIONS = ("none", "int8", "gguf")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    arch: ModelShape
    dtype: torch.dtype
    device: torch.device
    source: ModelSource
    dtype_reason: str = ""  # why this dtype: asked for, or what `auto` found on this machine
    quantization: str = "none"  # model.quantization (QUANTIZATIONS)


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    return resolve_dtype_for(dtype, device)[0]


def resolve_dtype_for(
    dtype: str | torch.dtype,
    device: torch.device,
    config: PretrainedConfig | None = None,
    quantization: str = "none",
) -> tuple[torch.dtype, str]:
    """-> (dtype, why). `auto` on CPU with the model's config: bfloat16 where the CPU has native bf16 matmuls and
    they are measured faster at the model's projection shape, float32 elsewhere; float32 with quantized weights,
    whose kernels (and the native decode step around them) take float32 activations."""
    if isinstance(dtype, torch.dtype):
        return dtype, "asked for"
    if dtype == "auto":
        if device.type == "cpu" and quantization != "none":
            return torch.float32, f"auto: float32 activations for {quantization} weights"
        if device.type == "cpu" and config is not None:
            choice = choose_cpu_dtype(
                config.hidden_size, getattr(config, "intermediate_size", config.hidden_size)
            )
            return choice.dtype, choice.reason
        chosen = AUTO_DTYPE.get(device.type, torch.float32)
        return chosen, f"auto: {str(chosen).removeprefix('torch.')} on {device.type}"
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, {', '.join(DTYPES)}")
    return DTYPES[dtype], "asked for"


def load_model(
    path: str,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    kernel_backend: str = "torch",
    base_dir: str | Path | None = None,
    quantization: str = "none",
    compile: bool | None = None,
    shard: Shard = Shard(),
) -> LoadedModel:
    """`shard`: under tensor parallelism, the rank whose part of the weights to read (each reads only its own)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {', '.join(QUANTIZATIONS)}")
    source = resolve_model_source(path, Path(base_dir) if base_dir is not None else None)
    folder = source.path if source.kind == "hf" else ensure_converted(source.path)
    raw = json.loads((folder / "config.json").read_text())
    cls = model_class(raw.get("architectures"), raw.get("model_type"))  # before transformers parses it
    config = read_model_config(folder)
    rope_inv_freq(config, head_dim_of(config))  # an unsupported rope type fails before the weights load
    dev = resolve_device(device)
    if quantization != "none" and dev.type != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on CPU only (device {dev.type})")
    if quantization == "gguf" and (source.kind != "gguf" or shard.size > 1):
        raise ValueError(
            "quantization 'gguf' serves a .gguf file's own quantized weights on one CPU process "
            f"(model {source.display}{', tensor_parallel > 1' if shard.size > 1 else ''})"
        )
    torch_dtype, dtype_reason = resolve_dtype_for(dtype, dev, config, quantization)
    log.info("dtype %s (%s)", str(torch_dtype).removeprefix("torch."), dtype_reason)
    if dev.type == "cpu" and torch_dtype == torch.float16:
        log.warning(FLOAT16_ON_CPU)
    backend = resolve_backend(kernel_backend, dev.type)
    if dev.type == "cpu":
        keep_freed_memory_in_heap()
    max_positions = max_positions_of(config)
    model = build_model(cls, config, backend, max_positions, torch_dtype, dev, shard)
    pick = shard_picker(shard, model.split_of) if shard.size > 1 else None
    with torch.no_grad():
        model.load_weights(iter_safetensors(folder, pick))
    model.finish_loading(dev)
    model.eval().requires_grad_(False)
    if quantization == "gguf":
        keep_gguf_blocks(model, source.path, config)
    if shard.size > 1 and compile:
        log.warning("engine.compile is not used with tensor_parallel > 1: the layers run eager")
        compile = False
    speed_up(model, dev, torch_dtype, backend, quantization, compile)
    tokenizer = AutoTokenizer.from_pretrained(folder, config=config)  # not parsing config.json again
    arch = model_shape(config, max_positions, eos_token_ids(folder, config, tokenizer))
    return LoadedModel(model, tokenizer, arch, torch_dtype, dev, source, dtype_reason, quantization)


def keep_gguf_blocks(model: torch.nn.Module, path: Path, config: PretrainedConfig) -> None:
    """model.quantization gguf: the projections stored in a block type the CPU kernel reads run from those blocks
    (engine/gguf_blocks.py); the rest stay as the dequantized checkpoint loaded them."""
    heads = config.num_attention_heads
    blocks = read_block_weights(path, heads, getattr(config, "num_key_value_heads", None) or heads)
    replaced = model.use_block_weights(blocks)
    kinds = sorted({b.fmt.name for b in blocks.values()})
    log.info("gguf blocks: %d projections kept quantized (%s)", len(replaced), ", ".join(kinds) or "none")


def read_hf_config(path: str, base_dir: str | Path | None = None) -> PretrainedConfig:
    """The model's config as load_model reads it (a GGUF file is converted into the cache first)."""
    source = resolve_model_source(path, Path(base_dir) if base_dir is not None else None)
    folder = source.path if source.kind == "hf" else ensure_converted(source.path)
    return read_model_config(folder)


# what nn.Linear, nn.Embedding and the norms' reset_parameters call
INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")


@contextmanager
def skip_param_init() -> Iterator[None]:
    """No random init for parameters the checkpoint overwrites: on meta tensors it runs torch's Python reference
    ops, whose first use imports torch._dynamo (about 1.5 s at every engine start)."""
    saved = {name: getattr(torch.nn.init, name) for name in INIT_FUNCTIONS}
    for name in INIT_FUNCTIONS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def build_model(
    cls: type[torch.nn.Module],
    config: PretrainedConfig,
    backend: str,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    shard: Shard = Shard(),
) -> torch.nn.Module:
    """Uninitialised parameters of `dtype` on `device`: every one is overwritten by the checkpoint."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"), skip_param_init():
            model = cls(config, backend, max_positions, shard)
    finally:
        torch.set_default_dtype(previous)
    return materialize(model, device)


def materialize(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """What model.to_empty(device=device) does (uninitialised storage for every meta parameter and buffer), with
    shared parameters kept shared and without to_empty's empty_like on meta tensors, whose Python reference ops
    import torch's symbolic shapes and sympy: 0.6 s of every engine start (AMD EPYC Zen 3, 2026-12-08)."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor, as_parameter: bool) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = torch.nn.Parameter(new, t.requires_grad) if as_parameter else new
        return made[id(t)]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = empty(p, as_parameter=True)  # type: ignore[assignment]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = empty(b, as_parameter=False)
    return model


def speed_up(
    model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    backend: str,
    quantization: str = "none",
    compile: bool | None = None,
) -> None:
    """CPU: int8 projections when asked for (model.quantization), else packed projections (native or oneDNN)
    (bench/RESULTS.md); then torch.compile of the decoder layers when asked for (engine.compile), its code cached
    on disk (inductor_cache_dir)."""
    if quantization == "int8":
        model.quantize_int8()
    elif device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and packed_linear_available(dtype):
        model.pack_for_cpu()
    if use_compile(device, backend, compile):
        use_inductor_cache_dir()
        model.compile_layers()


def inductor_cache_dir() -> Path:
    """Where inductor keeps compiled code (its FX graph cache): under the llmdeploy cache, so that a restart of
    the engine loads the compiled layers instead of compiling them again."""
    return cache_root() / "inductor"


def use_inductor_cache_dir() -> None:
    """Points inductor at inductor_cache_dir() unless TORCHINDUCTOR_CACHE_DIR was set by the user. torch sets the
    variable to its /tmp default itself on first use (importing torch.library does), so that value counts as
    unset; inductor reads the variable each time it looks for its cache."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or current == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())


def use_compile(device: torch.device, backend: str, requested: bool | None = None) -> bool:
    """LLMDEPLOY_COMPILE=1/0 forces torch.compile of the layers on or off; otherwise engine.compile, whose
    default is what bench/compile_start.py measured (CPU with the reference ops only: Triton kernels are already
    fused)."""
    flag = os.environ.get("LLMDEPLOY_COMPILE", "")
    if flag in ("0", "1"):
        return flag == "1"
    wanted = COMPILE_BY_DEFAULT if requested is None else requested
    return wanted and device.type == "cpu" and backend == "torch"


def iter_safetensors(
    folder: Path, pick: Callable[[str, Any], torch.Tensor] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint file; sharded folders are listed by model.safetensors.index.json.
    `pick(name, slice)`: the part of each tensor to read (a tensor-parallel rank's), else the whole tensor."""
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name) if pick is None else pick(name, f.get_slice(name))


def max_positions_of(config: PretrainedConfig) -> int:
    """Positions the model may see. A sliding window is full attention for sequences no longer than the window,
    so capping there keeps attention exact instead of silently ignoring the window."""
    limit = config.max_position_embeddings
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", True)  # Qwen2/3 carry a window they do not use
    if window and uses_window and window < limit:
        log.warning(
            "sliding_window=%d: sequences are limited to %d tokens (full attention within it)", window, window
        )
        limit = window
    return limit


def eos_token_ids(folder: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """generation_config.json first, then config.json, then the tokenizer; lists are kept whole."""
    found: list[int] = []
    gen = folder / "generation_config.json"
    sources = [json.loads(gen.read_text()).get("eos_token_id")] if gen.is_file() else []
    sources += [getattr(config, "eos_token_id", None)]
    if not any(s is not None for s in sources):
        sources.append(tokenizer.eos_token_id)
    for ids in sources:
        for i in ids if isinstance(ids, list) else [ids]:
            if i is not None and int(i) not in found:
                found.append(int(i))
    return found


def model_shape(config: PretrainedConfig, max_positions: int, eos_ids: list[int]) -> ModelShape:
    return ModelShape(
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim_of(config),
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        max_position_embeddings=max_positions,
        eos_token_ids=eos_ids,
    )


def keep_freed_memory_in_heap() -> None:
    """glibc returns big freed blocks to the OS, so every activation tensor of a forward costs fresh page faults
    (a 512x576 float32 RMSNorm took 0.65 ms instead of 0.05 ms). Keeping them in the heap is what jemalloc or
    tcmalloc would do; the process keeps its peak activation memory mapped."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # the largest glibc allows
    libc.mallopt(m_trim_threshold, 1 << 30)
