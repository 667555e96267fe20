"""`dtype: auto` on CPU must not flip on timing noise: a model whose projections take microseconds gets float32
wherever it runs (a tiny model once measured 1.17x in bf16 on an AVX-512 BF16 CPU and failed fp32 parity tests)."""

from __future__ import annotations

import torch

from llmdeploy.engine import cpu_dtype


def test_a_tiny_model_gets_float32_on_any_cpu(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: {"avx512_bf16"})  # as if the CPU had bf16 units
    cpu_dtype.choose_cpu_dtype.cache_clear()
    try:
        choice = cpu_dtype.choose_cpu_dtype(64, 128)
    finally:
        cpu_dtype.choose_cpu_dtype.cache_clear()
    # "too small" on an idle machine; on a busy one the timing may pass 50 us, and then 1.5x is not reached
    assert choice.dtype == torch.float32 and ("too small" in choice.reason or "only" in choice.reason)


def test_no_bf16_units_means_float32(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: {"avx2", "fma"})
    cpu_dtype.choose_cpu_dtype.cache_clear()
    try:
        choice = cpu_dtype.choose_cpu_dtype(576, 1536)
    finally:
        cpu_dtype.choose_cpu_dtype.cache_clear()
    assert choice.dtype == torch.float32 and "no AVX-512 BF16 or AMX" in choice.reason
