"""bench/step_overhead.py splits a decode step into its parts: the forward must be found on every path a step takes
(the Python model and head, or the native call from token ids to logits that replaces both on CPU), or the
overhead it reports is the whole step."""

from __future__ import annotations

import pytest

from bench.step_overhead import measure
from llmdeploy.engine import LLM
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("overhead"), "qwen2")


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_forward_is_timed_on_every_decode_path(folder, monkeypatch, native, dtype):
    llm = LLM(model=str(folder), dtype=dtype, max_model_len=128, kv_cache_gb=0.01, decode_burst=1)
    model = llm.engine.runner.model
    if not native:  # as where the native library is not built: the Python model and head run
        monkeypatch.setattr(model, "decode_logits", lambda *args: None, raising=False)
    rows = measure(llm, batch=4, prompt_len=12, steps=5)
    assert len(rows) == 5
    for row in rows:
        assert 0 < row["forward"] < row["step"]
        assert row["rest"] >= 0
        assert row["schedule"] > 0 and row["prepare"] > 0 and row["sample"] > 0
