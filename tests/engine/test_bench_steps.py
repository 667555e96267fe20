"""The benchmarks that time engine decode steps time real work on every path a step takes: bench/step_overhead.py
finds the forward (the Python model and head, or the native call from token ids to logits that replaces both on
CPU; else the overhead it reports is the whole step), and bench/small_batches.py times steps that still have
tokens to make when a decode burst makes several a step (else its small batches read 0.01 ms)."""

from __future__ import annotations

import pytest

from bench.small_batches import decode_step_ms
from bench.step_overhead import measure
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
    rows = measure(llm, batch=4, prompt_len=12, steps=5)
    assert len(rows) == 5
    for row in rows:
        assert 0 < row["forward"] < row["step"]
        assert row["rest"] >= 0
        assert row["schedule"] > 0 and row["prepare"] > 0 and row["sample"] > 0


@pytest.mark.parametrize("burst", [1, 4])
@pytest.mark.parametrize("batch", [1, 3])
def test_small_batch_steps_all_make_tokens(folder, batch, burst):
    llm = engine(folder, "float32", burst)
    ms, context = decode_step_ms(llm, batch, prompt_len=12, steps=6, salt=1)  # asserts each step made a token
    assert ms > 0
    assert 12 < context < 12 + 6 * burst + 2
    assert not llm.engine.has_unfinished()
