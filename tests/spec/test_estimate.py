"""Memory and KV capacity estimates from a model's config, without loading weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from llmdeploy.engine.estimate import GiB, estimate
from llmdeploy.spec.model_shape import ModelShape, read_hf_shape, read_model_shape
from llmdeploy.spec.models import DeploymentSpec
from llmdeploy.spec.sources import resolve_model_source
from tests.helpers.safetensors_files import write_safetensors


def fake_model(folder: Path, **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(
        model_type="llama",
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=256,
        vocab_size=1000,
        max_position_embeddings=4096,
    )
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps(cfg))
    write_safetensors(folder / "model-00001.safetensors", {"embed": [1000, 256], "w": [256, 256]})
    write_safetensors(folder / "model-00002.safetensors", {"norm": [256]})
    return folder


def shape(**over) -> ModelShape:
    base = dict(
        model_type="llama",
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        hidden_size=256,
        vocab_size=1000,
        max_position_embeddings=4096,
        num_params=1_000_000,
        file_bytes=4_000_000,
    )
    return ModelShape(**{**base, **over})


def test_hf_shape_comes_from_config_and_headers(tmp_path):
    s = read_hf_shape(fake_model(tmp_path / "m"))
    assert (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (4, 8, 2, 32)  # head_dim = 256 / 8
    assert s.num_params == 1000 * 256 + 256 * 256 + 256
    assert s.kv_bytes_per_token(2) == 2 * 4 * 2 * 32 * 2


def test_hf_shape_counts_the_files_the_engine_loads(tmp_path):
    folder = fake_model(tmp_path / "m")
    write_safetensors(folder / "consolidated.safetensors", {"embed": [1000, 256]})  # another scheme's copy
    assert read_hf_shape(folder).num_params == 1000 * 256 + 256 * 256 + 256


def test_hf_shape_honours_explicit_head_dim_and_nested_text_config(tmp_path):
    folder = fake_model(tmp_path / "m", head_dim=64)
    assert read_hf_shape(folder).head_dim == 64
    nested = {"model_type": "llava", "text_config": json.loads((folder / "config.json").read_text())}
    (folder / "config.json").write_text(json.dumps(nested))
    assert read_hf_shape(folder).head_dim == 64


def test_capacity_on_cpu_follows_kv_cache_gb():
    spec = DeploymentSpec.model_validate(
        {
            "model": {"dtype": "bfloat16", "max_model_len": 2048},
            "engine": {"kv_cache_gb": 0.5, "block_size": 16},
        }
    )
    est = estimate(spec, shape(), "cpu")
    per_token = 2 * 4 * 2 * 32 * 2
    assert est.kv_bytes_per_token == per_token
    assert est.weights_bytes == 1_000_000 * 2
    assert est.kv_blocks == (GiB // 2) // (per_token * 16)
    assert est.kv_tokens == est.kv_blocks * 16
    assert est.max_model_len_seqs == est.kv_tokens // 2048
    assert est.notes == []


def test_auto_dtype_on_cpu_counts_float32_and_says_so():
    est = estimate(DeploymentSpec(), shape(), "cpu")
    assert est.dtype == "float32" and est.weights_bytes == 4_000_000
    note = next(n for n in est.notes if "dtype auto" in n)
    # the choice left to the user, and what it buys
    assert "float32" in note and "model.dtype: bfloat16" in note


def test_auto_dtype_on_a_bf16_cpu_states_the_engine_s_own_threshold():
    from llmdeploy.policies import dtype_auto

    est = estimate(DeploymentSpec(), shape(), "cpu", cpu_bf16="avx512_bf16")
    assert est.dtype == "float32"
    note = next(n for n in est.notes if "dtype auto" in n)
    assert f"{dtype_auto.MIN_SPEEDUP:g}x" in note and "avx512_bf16" in note


def test_auto_dtype_with_quantized_weights_says_float32_activations():
    spec = DeploymentSpec.model_validate({"model": {"quantization": "int8"}})
    est = estimate(spec, shape(), "cpu", cpu_bf16="avx512_bf16")
    assert est.dtype == "float32"
    note = next(n for n in est.notes if "dtype auto" in n)
    assert "int8" in note and "float32 activations" in note and "bfloat16 if" not in note


def test_float16_on_cpu_is_flagged_and_on_cuda_is_not():
    spec = DeploymentSpec.model_validate({"model": {"dtype": "float16"}})
    cpu = estimate(spec, shape(), "cpu")
    assert any(n.startswith("model.dtype float16 on CPU") and "bfloat16" in n for n in cpu.notes)
    cuda = estimate(spec, shape(), "cuda", gpu_total_bytes=80 * GiB)
    assert not any("float16 on CPU" in n for n in cuda.notes)


def test_cuda_budget_is_utilisation_minus_weights():
    spec = DeploymentSpec.model_validate({"engine": {"gpu_memory_utilization": 0.5}})
    est = estimate(spec, shape(num_params=10**9), "cuda", gpu_total_bytes=80 * GiB)
    assert est.dtype == "bfloat16"
    assert est.kv_budget_bytes == 40 * GiB - 2 * 10**9


def test_notes_when_the_cache_or_the_model_is_too_small():
    spec = DeploymentSpec.model_validate({"model": {"max_model_len": 8192}, "engine": {"kv_cache_gb": 0.001}})
    est = estimate(spec, shape(), "cpu")
    assert est.max_model_len_seqs == 0
    assert any("less than one sequence" in n for n in est.notes)
    assert any("exceeds the model's context 4096" in n for n in est.notes)


def test_tiny_llama_shape_matches_its_weights(tiny_llama):
    from safetensors import safe_open

    s = read_model_shape(resolve_model_source(str(tiny_llama)))
    config = json.loads((tiny_llama / "config.json").read_text())
    assert s.num_layers == config["num_hidden_layers"] and s.num_kv_heads == config["num_key_value_heads"]
    assert s.head_dim == config["hidden_size"] // config["num_attention_heads"]
    total = 0
    for f in tiny_llama.glob("*.safetensors"):
        with safe_open(f, "np") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())  # noqa: SIM118
    assert s.num_params == total


@pytest.mark.slow
def test_builtin_smollm2_gguf_shape():
    s = read_model_shape(resolve_model_source("builtin:smollm2-135m-instruct"))
    assert (s.model_type, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == ("llama", 30, 9, 3, 64)
    assert s.vocab_size == 49152 and s.max_position_embeddings == 8192
    assert 130e6 < s.num_params < 140e6  # 135M, embeddings tied
    assert s.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4
