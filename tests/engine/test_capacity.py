"""KV cache sizing at start: capacity reported in tokens and sequences; a cache too small is a clear error."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from llmdeploy.engine import LLM, EngineConfig, SamplingParams
from llmdeploy.engine.errors import CapacityError, ContextLengthError
from llmdeploy.spec.models import DeploymentSpec

TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K+V x 2 layers x 16 tokens x 2 kv heads x head_dim 16 x fp32


def test_capacity_from_kv_cache_gb_is_reported(tiny_llama, caplog):
    caplog.set_level(logging.INFO, logger="llmdeploy.engine")
    gb = 0.001
    llm = LLM(model=str(tiny_llama), max_model_len=128, kv_cache_gb=gb, dtype="float32")
    cap = llm.engine.capacity
    assert cap.num_blocks == int(gb * (1 << 30)) // TINY_BLOCK_BYTES
    assert cap.tokens == cap.num_blocks * 16 and cap.max_model_len_seqs == pytest.approx(cap.tokens / 128)
    line = next(r.getMessage() for r in caplog.records if "KV cache" in r.getMessage())
    assert f"{cap.tokens} tokens" in line and "sequences of max_model_len 128" in line


def test_too_small_for_one_sequence_is_a_clear_error(tiny_llama):
    with pytest.raises(CapacityError) as e:
        LLM(model=str(tiny_llama), max_model_len=1024, kv_cache_gb=0.0001)
    msg = str(e.value)
    assert "max_model_len=1024" in msg and "kv_cache_gb" in msg and "tokens" in msg


def test_max_model_len_is_capped_by_the_model(tiny_llama, caplog):
    llm = LLM(
        model=str(tiny_llama), max_model_len=4096, kv_cache_gb=0.05
    )  # the tiny model has 1024 positions
    assert llm.engine.config.max_model_len == 1024
    with pytest.raises(ContextLengthError):
        llm.generate([[1] * 1000], SamplingParams(max_tokens=100))


def test_request_that_can_never_fit_is_rejected_at_once(tiny_llama):
    llm = LLM(model=str(tiny_llama), max_model_len=128, kv_cache_gb=0.01)
    with pytest.raises(ContextLengthError) as e:
        llm.generate([[5] * 100], SamplingParams(max_tokens=50))
    assert "128" in str(e.value) and "100 in the prompt" in str(e.value)
    assert not llm.engine.has_unfinished()
    out = llm.generate([[5] * 100], SamplingParams(max_tokens=28, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 28


def test_generation_without_max_tokens_stops_at_max_model_len(tiny_llama):
    llm = LLM(model=str(tiny_llama), max_model_len=64, kv_cache_gb=0.01)
    out = llm.generate([[5] * 50], SamplingParams(max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 14 and out.finish_reason == "length"


def test_engine_config_from_spec_uses_the_yaml_names():
    spec = DeploymentSpec.model_validate(
        {
            "model": {"path": "/m", "dtype": "bfloat16", "max_model_len": 4096},
            "engine": {
                "block_size": 32,
                "max_num_seqs": 8,
                "max_num_batched_tokens": 512,
                "kv_cache_gb": 2.5,
                "prefix_caching": False,
                "seed": 7,
            },
        }
    )
    c = EngineConfig.from_spec(spec)
    assert (
        c.model,
        c.dtype,
        c.max_model_len,
        c.block_size,
        c.max_num_seqs,
        c.max_num_batched_tokens,
        c.kv_cache_gb,
        c.prefix_caching,
        c.seed,
    ) == ("/m", "bfloat16", 4096, 32, 8, 512, 2.5, False, 7)
    with pytest.raises(dataclasses.FrozenInstanceError):  # built once, the same settings for every part
        c.block_size = 16  # type: ignore[misc]


def test_engine_config_rejects_what_the_yaml_rejects():
    with pytest.raises(ValueError):
        EngineConfig(model="/m", block_size=12)
    with pytest.raises(ValueError):
        EngineConfig(model="/m", max_num_batched_tokens=8, block_size=16)


def test_unknown_llm_argument_is_an_error(tiny_llama):
    with pytest.raises(TypeError, match="max_batch"):
        LLM(model=str(tiny_llama), max_batch=4)


def test_cache_larger_than_available_memory_is_refused_at_start(tiny_llama):
    # the cache's pages are committed lazily, so without this check the engine would start and die at the OOM
    # killer once the cache filled
    with pytest.raises(CapacityError) as e:
        LLM(model=str(tiny_llama), max_model_len=128, kv_cache_gb=100_000)
    assert "kv_cache_gb=100000" in str(e.value) and "available memory" in str(e.value)


def test_cpu_cache_buffer_is_zeroed_aligned_and_writable():
    import torch

    from llmdeploy.engine.model_runner import zeroed

    kv = zeroed((2, 3, 5, 16, 2, 8), torch.bfloat16, torch.device("cpu"))
    assert kv.shape == (2, 3, 5, 16, 2, 8) and kv.dtype == torch.bfloat16 and kv.is_contiguous()
    assert kv.data_ptr() % 64 == 0 and not kv.any()
    kv[1, 2] = 1.5
    assert float(kv.sum()) == 1.5 * 5 * 16 * 2 * 8
