"""model.quantization: int8 (the loaded weights as Q8 blocks) and gguf (a GGUF file's own Q8_0 / Q4_0 / Q4_1
blocks) on CPU: the quantizer's round trip, the layer against its dequantized float32 form, the GGUF blocks equal
to what transformers' dequantizing loader reads (rows un-permuted, q|k|v and gate|up fused), the model's logits
against float32, the engine serving both, and the clear errors for what they do not cover."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from llmdeploy.engine import LLM, SamplingParams
from llmdeploy.engine.loader import load_model
from llmdeploy.engine.models import quant
from llmdeploy.engine.models.quant import QuantLinear, quantize_q8
from llmdeploy.kernels.native_quant import QFormat
from llmdeploy.spec.models import ModelSpec
from tests.engine.paged_driver import PagedDriver
from tests.engine.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_quantize_q8_round_trip():
    w = torch.randn(37, 64) * torch.linspace(0.01, 3, 37)[:, None]  # channels of very different ranges
    blocks = quantize_q8(w)
    assert blocks.fmt == QFormat.Q8 and blocks.q.dtype == torch.int8 and int(blocks.q.abs().max()) <= 127
    assert blocks.d.shape == (37, 2) and blocks.d.dtype == torch.float16
    step = blocks.d.float().repeat_interleave(32, dim=1)
    assert bool(((blocks.dequantize() - w).abs() <= step / 2 + 1e-7).all())  # within half a step of its block
    assert bool((blocks.q.abs().amax(dim=1) >= 126).all())  # each block's scale uses the int8 range


def test_quantize_q8_in_row_chunks_is_the_same(monkeypatch):
    w = torch.randn(10, 96) * torch.linspace(0.01, 3, 10)[:, None]
    whole = quantize_q8(w)
    monkeypatch.setattr(quant, "QUANTIZE_ROWS", 3)
    chunked = quantize_q8(w)
    assert torch.equal(chunked.q, whole.q) and torch.equal(chunked.d, whole.d)
    assert chunked.in_features == whole.in_features == 96 and chunked.m is None


@pytest.mark.parametrize("rows", [1, 3, 8, 200])
def test_quant_linear_equals_its_dequantized_weights(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    layer = QuantLinear(quantize_q8(w), b)
    x = torch.randn(rows, 64, generator=g)
    ref = torch.nn.functional.linear(x.double(), layer.weight.double(), b.double())
    # the VNNI kernel rounds x to int8 per block (tests/kernels/test_quant_kernels.py has its exact definition)
    assert float((layer(x).double() - ref).norm() / ref.norm()) < 0.02
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_int8_model_logits_stay_close_to_float32(tiny_model):
    folder = tiny_model("llama")
    fp, q8 = (
        load_model(str(folder), dtype="float32"),
        load_model(str(folder), dtype="float32", quantization="int8"),
    )
    assert q8.quantization == "int8"
    assert isinstance(q8.model.model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert isinstance(q8.model.lm_head, QuantLinear)  # the tied or untied head: int8 as well
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


# a GGUF file as llama.cpp's quantizer writes one: most projections Q4_1, the attention output Q4_0, the embedding
# (also the tied head) Q8_0, one layer's down projection left float32 (served from the dequantized checkpoint)
MIXED = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_0", "ffn_gate": "Q4_1"}
MIXED |= {"ffn_up": "Q4_1", "blk.0.ffn_down.weight": "Q8_0", "token_embd": "Q8_0", "output": "Q8_0"}


@pytest.fixture
def quantized_gguf(tmp_path, monkeypatch, tiny_model):
    monkeypatch.setenv("LLMDEPLOY_CACHE_DIR", str(tmp_path / "cache"))
    return write_tiny_gguf(tiny_model("llama"), tmp_path / "q.gguf", quant=MIXED)


def test_gguf_blocks_are_what_the_dequantizing_loader_reads(quantized_gguf):
    dense = load_model(str(quantized_gguf), dtype="float32")
    kept = load_model(str(quantized_gguf), dtype="float32", quantization="gguf")
    assert kept.quantization == "gguf"
    layer0, layer1 = kept.model.model.layers[0], kept.model.model.layers[1]
    assert layer0.self_attn.qkv_proj.fmt == QFormat.Q4 and layer0.self_attn.o_proj.fmt == QFormat.Q4
    assert layer0.mlp.down_proj.fmt == QFormat.Q8
    assert not isinstance(layer1.mlp.down_proj, QuantLinear)  # float32 in the file: dense, as before
    assert kept.model.lm_head.fmt == QFormat.Q8
    dense_modules = dict(dense.model.named_modules())
    checked = 0
    for name, module in kept.model.named_modules():
        if isinstance(module, QuantLinear):  # bit for bit: the un-permuted, fused blocks
            torch.testing.assert_close(module.weight, dense_modules[name].weight, atol=0, rtol=0)
            checked += 1
    assert checked == 2 * 4 - 1 + 1  # qkv, o, gate_up in both layers, one down, the head
    ids = list(range(5, 45))
    with torch.inference_mode():
        logits = []
        for lm in (dense, kept):
            driver = PagedDriver(lm.model, lm.arch, lm.dtype, max_seqs=1, max_len=64)
            hidden, _ = driver.forward([(driver.new_seq(ids), len(ids))], [])
            logits.append(lm.model.compute_logits(hidden))
    diff, scale = float((logits[0] - logits[1]).abs().max()), float(logits[0].abs().max())
    assert diff < 0.1 * scale, (diff, scale)  # only x's int8 rounding (VNNI) or summation order differ


def test_engine_serves_gguf_blocks(quantized_gguf):
    llm = LLM(model=str(quantized_gguf), quantization="gguf", max_model_len=128, kv_cache_gb=0.01)
    outs = llm.generate(
        [[5, 6, 7], list(range(10, 50))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    assert llm.engine.runner.loaded.quantization == "gguf"
    # dtype auto (the default) with quantized weights: float32 activations, and the log and status say why
    assert llm.engine.runner.loaded.dtype == torch.float32
    assert llm.engine.runner.loaded.dtype_reason == "auto: float32 activations for gguf weights"


def test_gguf_quantization_needs_a_gguf_file(tiny_model):
    with pytest.raises(ValueError, match="gguf file's own quantized weights"):
        load_model(str(tiny_model("llama")), quantization="gguf")
    with pytest.raises(ValidationError, match="model.path must be a .gguf file"):
        ModelSpec(path="models/llama", quantization="gguf")
    assert ModelSpec(path="m/x.gguf", quantization="gguf").quantization == "gguf"
    assert ModelSpec(path="builtin:smollm2-135m-instruct", quantization="gguf").quantization == "gguf"
