"""The benchmarks that time engine decode steps time real work on every path a step takes: bench/step_overhead.py
finds the forward (the Python model and head, or the native call from token ids to logits that replaces both on
CPU; else the overhead it reports is the whole step), and bench/small_batches.py times steps that still have
tokens to make when a decode burst makes several a step (else its small batches read 0.01 ms)."""

from __future__ import annotations

import pytest
import torch

from bench.small_batches import decode_step_ms
from bench.step_overhead import measure
from llmdeploy.engine import SamplingParams
from tests.engine.test_decode_burst import engine
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("overhead"), "qwen2")


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_forward_is_timed_on_every_decode_path(folder, monkeypatch, native, dtype):
    llm = engine(folder, dtype, burst=1)
    model = llm.engine.runner.model
    if not native:  # as where the native library is not built: the Python model and head run
        monkeypatch.setattr(model, "decode_logits", lambda *args: None, raising=False)
        monkeypatch.setattr(model, "decode_greedy", lambda *args: None, raising=False)
    rows = measure(llm, batch=4, prompt_len=12, steps=5)
    assert len(rows) == 5
    # greedy steps the head's screen reads (native, float32 at 4 rows) take their tokens from the native call
    screened = native and dtype == "float32" and llm.engine.runner.screens_head(4)
    for row in rows:
        assert 0 < row["forward"] < row["step"]
        assert row["rest"] >= 0
        assert row["schedule"] > 0 and row["prepare"] > 0
        assert (row["sample"] == 0) if screened else (row["sample"] > 0)


@pytest.mark.parametrize("burst", [1, 4])
@pytest.mark.parametrize("batch", [1, 3])
def test_small_batch_steps_all_make_tokens(folder, batch, burst):
    llm = engine(folder, "float32", burst)
    ms, context = decode_step_ms(llm, batch, prompt_len=12, steps=6, salt=1)  # asserts each step made a token
    assert ms > 0
    assert 12 < context < 12 + 6 * burst + 2
    assert not llm.engine.has_unfinished()


def test_the_sampling_bench_baseline_is_the_old_sampler_and_is_undone(folder, monkeypatch):
    """bench/sampling_steps.py's baseline: no native draw, a sort for top_k/top_p, no sampled bursts; and this
    sampler back after it (else its 'this sampler' column would time the baseline)."""
    from bench import sampling_steps as bench
    from llmdeploy.engine import sampling_filters
    from llmdeploy.kernels.decode_step import DecodeLayers

    llm = engine(folder, "float32", burst=4)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True, seed=2)
    sorted_rows, bursts = [], []
    by_sort, greedy = sampling_filters.top_k_top_p_by_sort, DecodeLayers.greedy
    monkeypatch.setattr(
        sampling_filters, "top_k_top_p_by_sort", lambda *a: sorted_rows.append(1) or by_sort(*a)
    )
    monkeypatch.setattr(DecodeLayers, "greedy", lambda *a: bursts.append(1) or greedy(*a))
    with bench.baseline():
        assert bench.cpu_native.sample_rows(torch.zeros(1, 4), [1.0], [0.0], [0.5]) is None
        assert bench.cpu_native.top_k_top_p_rows(torch.zeros(1, 4), [2], [1.0]) is None
        assert bench.step_ms(llm, 2, params, steps=3, salt=1, prompt_len=12) > 0
        plain = SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True)
        assert bench.step_ms(llm, 2, plain, steps=3, salt=2, prompt_len=12) > 0
    assert sorted_rows and not bursts  # the baseline sorted every top_p row, and sampled rows never burst
    assert bench.cpu_native.sample_rows(torch.zeros(1, 4), [1.0], [0.0], [0.5]) in ([0], [1], [2], [3], None)
    assert bench.sampler_mod.top_k_top_p is sampling_filters.top_k_top_p
    assert bench.cpu_native.top_k_top_p_rows(torch.zeros(1, 4), [2], [1.0]) is not None or not (
        bench.cpu_native.native_build.available()
    )
    assert bench.llm_engine.plain_sampled is bench.sampler_mod.plain_sampled
