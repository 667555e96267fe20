"""`dtype: auto` on CPU must not flip on timing noise: a model whose projections take microseconds gets float32
wherever it runs (a tiny model once measured 1.17x in bf16 on an AVX-512 BF16 CPU and failed fp32 parity tests)."""

from __future__ import annotations

import pytest
import torch

from llmdeploy.engine import cpu_dtype, start_measures


@pytest.fixture(autouse=True)
def nothing_kept(tmp_path, monkeypatch):
    """Each test times its own choice: none kept from an earlier run (engine/start_measures.py)."""
    monkeypatch.setattr(start_measures, "measures_dir", lambda: tmp_path / "measures")
    cpu_dtype.choose_cpu_dtype.cache_clear()
    yield
    cpu_dtype.choose_cpu_dtype.cache_clear()


def test_a_tiny_model_gets_float32_on_any_cpu(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: {"avx512_bf16"})  # as if the CPU had bf16 units
    cpu_dtype.choose_cpu_dtype.cache_clear()
    try:
        choice = cpu_dtype.choose_cpu_dtype(64, 128)
    finally:
        cpu_dtype.choose_cpu_dtype.cache_clear()
    # "too small" on an idle machine; on a busy one the timing may pass 50 us, and then 1.5x is not reached
    assert choice.dtype == torch.float32 and ("too small" in choice.reason or "only" in choice.reason)


def test_the_timed_choice_is_kept_for_the_next_start(monkeypatch, tmp_path):
    """A restart serves the dtype the first start measured (a fresh timing near the threshold could flip it) and
    does not time again; a broken file is timed again."""
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: {"amx_bf16"})
    timings = []
    real = cpu_dtype.projection_seconds
    monkeypatch.setattr(cpu_dtype, "projection_seconds", lambda *a, **k: timings.append(a) or real(*a, **k))
    first = cpu_dtype.choose_cpu_dtype(64, 128)
    cpu_dtype.choose_cpu_dtype.cache_clear()  # as a new process
    again = cpu_dtype.choose_cpu_dtype(64, 128)
    assert len(timings) == 1
    assert again.dtype == first.dtype and again.reason == f"{first.reason}, kept from an earlier start"
    (kept,) = (tmp_path / "measures").glob("*.json")
    kept.write_text('{"dtype": "float64"}')
    cpu_dtype.choose_cpu_dtype.cache_clear()
    assert "kept" not in cpu_dtype.choose_cpu_dtype(64, 128).reason and len(timings) == 2
    cpu_dtype.choose_cpu_dtype.cache_clear()
    cpu_dtype.choose_cpu_dtype(64, 256)  # another shape is timed on its own
    assert len(timings) == 3 and len(list((tmp_path / "measures").glob("*.json"))) == 2


def test_no_bf16_units_means_float32(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: {"avx2", "fma"})
    cpu_dtype.choose_cpu_dtype.cache_clear()
    try:
        choice = cpu_dtype.choose_cpu_dtype(576, 1536)
    finally:
        cpu_dtype.choose_cpu_dtype.cache_clear()
    assert choice.dtype == torch.float32 and "no AVX-512 BF16 or AMX" in choice.reason


def test_auto_with_quantized_weights_is_float32_even_where_bf16_would_win(monkeypatch):
    """The quantized kernels and the native decode step around them take float32 activations: bf16 ones ran the
    Python layers (SmolLM2 int8 on Zen 4: batch-1 decode 2.1x float32's time), so `auto` must not pick bf16 there."""
    from transformers import LlamaConfig

    from llmdeploy.engine import loader

    bf16 = cpu_dtype.DtypeChoice(torch.bfloat16, "auto: bfloat16 measured faster")
    monkeypatch.setattr(loader, "choose_cpu_dtype", lambda hidden, inter: bf16)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536)
    cpu = torch.device("cpu")
    assert loader.resolve_dtype_for("auto", cpu, config) == (torch.bfloat16, bf16.reason)
    for quantization in ("int8", "gguf"):
        dtype, reason = loader.resolve_dtype_for("auto", cpu, config, quantization)
        assert dtype == torch.float32 and quantization in reason
    # asked for is asked for; on CUDA quantization is refused before this
    assert loader.resolve_dtype_for("bfloat16", cpu, config, "int8") == (torch.bfloat16, "asked for")


def test_float16_on_cpu_loads_with_a_warning(tiny_model, caplog):
    """float16 is served on CPU as asked, and the log says what it costs there (no native kernel takes it)."""
    from llmdeploy.engine import loader

    with caplog.at_level("WARNING", logger="llmdeploy.engine.loader"):
        lm = loader.load_model(str(tiny_model("llama")), dtype="float16")
    assert lm.dtype == torch.float16
    assert any("model.dtype float16 on CPU" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="llmdeploy.engine.loader"):
        loader.load_model(str(tiny_model("llama")), dtype="float32")
    assert not any("float16" in r.getMessage() for r in caplog.records)
