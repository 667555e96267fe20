"""bench/head_screen.py on a tiny model: each round times both sides, and the screened side's steps went through
the screen (its counts rose) while the other side's did not."""

from __future__ import annotations

import pytest

from bench.head_screen import alternate, layers_of
from llmdeploy.engine import LLM, SamplingParams
from llmdeploy.kernels import cpu_native, native_build
from tests.helpers.tiny_models import make_tiny_model


@pytest.mark.skipif(
    native_build.library() is None or not cpu_native.f32_linear_available(),
    reason="needs the native decode step",
)
def test_the_bench_alternates_the_screen_and_counts_its_steps(tmp_path):
    llm = LLM(
        model=str(make_tiny_model(tmp_path, "llama")), dtype="float32", max_model_len=256, kv_cache_gb=0.01
    )
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    runs = alternate(llm, "float32", rows=1, rounds=2, steps=3, prompt_len=16, probe_mib=16)
    assert len(runs.on) == len(runs.off) == 2
    assert all(ms > 0 and floor > 0 for ms, floor in runs.on + runs.off)
    assert runs.steps >= 2 * 3  # every screened timed step (and more: the bursts' untimed ones)
    assert runs.tiles >= runs.steps  # at least one candidate tile a step
    assert layers_of(llm).screen_struct is not None  # left on
    if cpu_native.avx512_bf16_available():  # a float32 head's bf16 copy screens single steps of more rows
        many = alternate(llm, "float32", rows=6, rounds=2, steps=3, prompt_len=16, probe_mib=16)
        assert many.steps >= 2 * 3 and many.tiles >= many.steps
