"""model.quantization: int8 — per-channel int8 weights on CPU: the layer against its dequantized float32 form (the
native kernel's small-row path and the large-row path), the model's logits against float32, the engine serving
with it, and the clear errors for what it does not cover."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from llmdeploy.engine import LLM, SamplingParams
from llmdeploy.engine.loader import load_model
from llmdeploy.engine.models.layers import INT8_KERNEL_MAX_ROWS, Int8Linear, quantize_int8
from llmdeploy.spec.models import ModelSpec
from tests.engine.paged_driver import PagedDriver


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_quantize_int8_round_trip():
    w = torch.randn(37, 64) * torch.linspace(0.01, 3, 37)[:, None]  # channels of very different ranges
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127 and scale.shape == (37,)
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())  # within half a step of each channel


@pytest.mark.parametrize("rows", [1, 3, 8, INT8_KERNEL_MAX_ROWS, INT8_KERNEL_MAX_ROWS + 1, 200])
def test_int8_linear_equals_its_dequantized_weights(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    layer = Int8Linear(w, b)
    x = torch.randn(rows, 32, generator=g)
    ref = torch.nn.functional.linear(x.double(), layer.weight.double(), b.double())
    torch.testing.assert_close(layer(x).double(), ref, atol=1e-4, rtol=1e-5)
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_int8_model_logits_stay_close_to_float32(tiny_model):
    folder = tiny_model("llama")
    fp, q8 = (
        load_model(str(folder), dtype="float32"),
        load_model(str(folder), dtype="float32", quantization="int8"),
    )
    assert q8.quantization == "int8"
    assert isinstance(q8.model.model.layers[0].self_attn.qkv_proj, Int8Linear)
    assert isinstance(q8.model.lm_head, Int8Linear)  # the tied or untied head: int8 as well
    ids = list(range(5, 45))
    out = []
    with torch.inference_mode():
        for lm in (fp, q8):
            driver = PagedDriver(lm.model, lm.arch, lm.dtype, max_seqs=1, max_len=64)
            hidden, _ = driver.forward([(driver.new_seq(ids), len(ids))], [])
            out.append(lm.model.compute_logits(hidden))
    diff, scale = float((out[0] - out[1]).abs().max()), float(out[0].abs().max())
    # random tiny models amplify errors (weights of std 0.2): about 3.5% of the logits' spread here
    assert diff < 0.1 * scale, (diff, scale)
    agree = float((out[0].argmax(-1) == out[1].argmax(-1)).float().mean())
    assert agree >= 0.8, agree


def test_engine_serves_int8(tiny_model):
    llm = LLM(
        model=str(tiny_model("qwen2")),
        dtype="float32",
        quantization="int8",
        max_model_len=128,
        kv_cache_gb=0.01,
    )
    outs = llm.generate(
        [[5, 6, 7], list(range(10, 50))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    assert llm.engine.runner.loaded.quantization == "int8"


def test_what_int8_does_not_cover_is_refused(tiny_model):
    with pytest.raises(ValueError, match="CPU only"):
        load_model(str(tiny_model("llama")), device="cuda", quantization="int8")
    with pytest.raises(ValueError, match="unknown quantization"):
        load_model(str(tiny_model("llama")), quantization="int4")
    with pytest.raises(ValidationError):
        ModelSpec(quantization="int4")
    assert ModelSpec(quantization="int8").quantization == "int8"
