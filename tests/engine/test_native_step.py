"""The native decode step (engine/models/native_step.py): a decode-only step's layers in one C call. It must give
the Python layers' output exactly (same kernels, same buffers, same order), run only where every part applies, and
leave everything untouched where it declines."""

from __future__ import annotations

import pytest
import torch

from llmdeploy.engine.loader import load_model
from llmdeploy.kernels import cpu_native, native_build
from llmdeploy.kernels.decode_step import DecodeLayers
from tests.engine.paged_driver import PagedDriver
from tests.helpers.tiny_models import make_tiny_model

CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),  # q/k/v bias
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen3": ("qwen3", {}),  # per-head q/k norm: not taken
    "head-dim-8": ("llama", {"hidden_size": 48, "num_attention_heads": 6}),  # rotary kernel needs D % 16
    "llama-tied": ("llama", {"tie_word_embeddings": True}),  # the embedding read from the packed head's rows
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    made = {}

    def build(case: str):
        if case not in made:
            arch, overrides = CASES[case]
            made[case] = make_tiny_model(tmp_path_factory.mktemp(case), arch, **overrides)
        return made[case]

    return build


@pytest.fixture
def runs(monkeypatch):
    """Each DecodeLayers.run's answer (True: the native step ran)."""
    answers: list[bool] = []
    real = DecodeLayers.run

    def spy(self, *args, **kwargs):
        answers.append(real(self, *args, **kwargs))
        return answers[-1]

    monkeypatch.setattr(DecodeLayers, "run", spy)
    return answers


def native_linear_for(dtype: str, quantization: str) -> bool:
    """Whether this CPU's build runs every projection natively for the variant (else the step cannot apply)."""
    if native_build.library() is None:
        return False
    if quantization != "none":
        return True
    return cpu_native.bf16_linear_available() if dtype == "bfloat16" else cpu_native.f32_linear_available()


def decode_hidden(
    lm, batch: int, native: bool | None, seed: int = 0
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One decode step of `batch` sequences at scattered contexts over a random cache: (hidden, the caches).
    native: force the native step on or off; None: as loaded."""
    driver, seqs, caches = decode_setup(lm, batch, native, seed)
    with torch.inference_mode():
        hidden, _ = driver.forward([], seqs)
    return hidden, [c.clone() for c in caches]


def decode_logits(
    lm, batch: int, native: bool, seed: int = 0
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """As decode_hidden, to logits: the one-call step (native) or the Python layers and head: (logits, caches)."""
    driver, seqs, caches = decode_setup(lm, batch, native, seed)
    with torch.inference_mode():
        logits = driver.decode_logits(seqs) if native else driver.step([], seqs)
    return logits, [c.clone() for c in caches]


def decode_setup(lm, batch: int, native: bool | None, seed: int):
    if native is not None:
        lm.model.model.native_decode.off = not native
    driver = PagedDriver(lm.model, lm.arch, lm.dtype, max_seqs=batch, max_len=64)
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for layer in lm.model.attention_layers():
        for cache in (layer.k_cache, layer.v_cache):
            cache.copy_(torch.randn(cache.shape, generator=gen))
            caches.append(cache)
    seqs = []
    for i in range(batch):
        ctx = 3 + 7 * i % 50
        seq = driver.new_seq([(5 * i + j) % 100 + 3 for j in range(ctx)])
        seq.num_cached = ctx - 1
        seqs.append(seq)
    return driver, seqs, caches


VARIANTS = [
    ("llama", "float32", "none"),
    ("qwen2", "float32", "none"),
    ("llama-bias", "float32", "none"),
    ("llama", "bfloat16", "none"),
    ("qwen2", "bfloat16", "none"),
    ("llama", "float32", "int8"),
    ("llama-tied", "float32", "none"),
    ("llama-tied", "bfloat16", "none"),
    ("llama-tied", "float32", "int8"),
]


@pytest.mark.parametrize("case,dtype,quantization", VARIANTS)
@pytest.mark.parametrize("batch", [1, 3, 13])
def test_native_step_equals_the_python_layers(model_dir, runs, case, dtype, quantization, batch):
    torch.set_num_threads(2)  # the kernels split rows and channels by thread: both sides split the same way
    lm = load_model(str(model_dir(case)), dtype=dtype, quantization=quantization)
    ref_hidden, ref_caches = decode_hidden(lm, batch, native=False)
    assert runs == []
    hidden, caches = decode_hidden(lm, batch, native=True)
    # where this build cannot run every projection natively, the step is declined (or never asked)
    assert (runs == [True]) == native_linear_for(dtype, quantization)
    assert torch.equal(hidden, ref_hidden)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches, strict=True))


@pytest.mark.parametrize("case", ["qwen3", "head-dim-8"])
def test_declines_what_it_does_not_take_and_matches_anyway(model_dir, runs, case):
    """q/k norm: never built; head_dim 8: the kernel refuses its shapes before writing anything."""
    lm = load_model(str(model_dir(case)), dtype="float32")
    ref_hidden, ref_caches = decode_hidden(lm, 3, native=False)
    hidden, caches = decode_hidden(lm, 3, native=True)
    assert True not in runs
    if case == "qwen3":
        assert runs == [] and lm.model.model.native_decode.layers is None
    assert torch.equal(hidden, ref_hidden)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches, strict=True))


def test_only_decode_only_steps_and_not_when_compiled(model_dir, runs):
    lm = load_model(str(model_dir("llama")), dtype="float32")
    driver = PagedDriver(lm.model, lm.arch, lm.dtype, max_seqs=3, max_len=64)
    a, b = driver.new_seq(list(range(3, 20))), driver.new_seq(list(range(30, 40)))
    with torch.inference_mode():
        driver.step([(a, 17)], [])  # prefill only
        b.num_cached = 9
        driver.step([], [b])  # decode only
        a.tokens.append(7)
        b.tokens.append(8)
        driver.step([], [a, b])  # decode only
        c = driver.new_seq(list(range(50, 60)))
        a.tokens.append(9)
        driver.step([(c, 10)], [a])  # mixed: prefill chunk + decode
    if native_linear_for(
        "float32", "none"
    ):  # the two decode-only steps ran it; the prefill and mixed ones not
        assert runs == [True, True]
    else:
        assert True not in runs
    asked = len(runs)
    lm.model.model.native_decode.disable()  # what compile_layers does
    decode_hidden(lm, 2, native=None)
    assert len(runs) == asked


def test_rebuilt_when_the_kv_cache_moves(model_dir, runs):
    """A new cache (the runner's after its warm-up) gets new pointers; the old ones must not be written."""
    lm = load_model(str(model_dir("llama")), dtype="float32")
    first, _ = decode_hidden(lm, 2, native=True, seed=1)
    old = lm.model.attention_layers()[0].k_cache
    old_copy = old.clone()
    second, _ = decode_hidden(lm, 2, native=True, seed=1)  # a new PagedDriver: fresh caches
    assert torch.equal(old, old_copy)
    assert torch.equal(first, second)


def test_the_switch_turns_it_off(model_dir, runs, monkeypatch):
    monkeypatch.setenv("LLMDEPLOY_NATIVE_DECODE", "0")
    lm = load_model(str(model_dir("llama")), dtype="float32")
    assert lm.model.model.native_decode.off
    decode_hidden(lm, 2, native=None)
    assert runs == []


def test_greedy_output_still_matches_transformers(model_dir):
    """fp32 greedy tokens through the engine's decode steps (native where it applies) = transformers'."""
    from transformers import AutoModelForCausalLM

    folder = model_dir("qwen2")
    lm = load_model(str(folder), dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompts = [[3, 17, 42, 9, 88], [5, 6], list(range(10, 40))]
    driver = PagedDriver(lm.model, lm.arch, lm.dtype, max_seqs=3, max_len=64)
    with torch.inference_mode():
        ours = driver.generate_greedy(prompts, 12)
    for ids, got in zip(prompts, ours, strict=True):
        mask = torch.ones(1, len(ids), dtype=torch.long)
        ref = hf.generate(torch.tensor([ids]), attention_mask=mask, max_new_tokens=12, do_sample=False)
        assert got == ref[0, len(ids) :].tolist()


def test_a_position_past_the_rotary_cache_is_declined_before_anything_is_written(model_dir):
    lm = load_model(str(model_dir("llama")), dtype="float32")
    decode_hidden(lm, 2, native=True)  # builds the native layers over that driver's cache
    layers = lm.model.model.native_decode.layers
    assert (layers is not None) == native_linear_for("float32", "none")
    if layers is None:
        return
    cos_sin = lm.model.cos_sin_cache
    hidden = torch.randn(1, layers.dims.hidden)
    residual = torch.randn(1, layers.dims.hidden)
    before = [hidden.clone(), residual.clone(), *(t.clone() for t in (layers.layers[0].k_cache,))]
    for pos in (cos_sin.shape[0], -1):
        ran = layers.run(
            hidden,
            residual,
            torch.tensor([pos]),
            cos_sin,
            torch.tensor([5]),
            torch.zeros(1, 4, dtype=torch.int32),
            torch.tensor([6], dtype=torch.int32),
        )
        assert not ran
        assert all(
            torch.equal(a, b)
            for a, b in zip(before, [hidden, residual, layers.layers[0].k_cache], strict=True)
        )
    assert layers.run(
        hidden,
        residual,
        torch.tensor([cos_sin.shape[0] - 1]),
        cos_sin,
        torch.tensor([5]),
        torch.zeros(1, 4, dtype=torch.int32),
        torch.tensor([6], dtype=torch.int32),
    )


@pytest.mark.parametrize("case,dtype,quantization", VARIANTS)
@pytest.mark.parametrize("batch", [1, 3, 13])
def test_one_call_logits_equal_the_python_head(model_dir, case, dtype, quantization, batch):
    """Embedding, layers, final norm and LM head in one call: the Python path's float32 logits, bit for bit."""
    torch.set_num_threads(2)
    lm = load_model(str(model_dir(case)), dtype=dtype, quantization=quantization)
    ref, ref_caches = decode_logits(lm, batch, native=False)
    got, caches = decode_logits(lm, batch, native=True)
    if not native_linear_for(dtype, quantization):
        assert got is None
        return
    assert got is not None and got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.equal(got, ref)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches, strict=True))


def test_one_call_logits_decline_a_head_without_a_native_kernel_and_a_bad_token(model_dir):
    """Nothing is written when the call declines: the caller runs the Python path over an untouched cache."""
    lm = load_model(str(model_dir("llama")), dtype="float32")
    driver, seqs, caches = decode_setup(lm, 2, native=True, seed=3)
    before = [c.clone() for c in caches]
    ids, pos, meta, _ = driver.inputs([], seqs)
    ids[1] = lm.arch.vocab_size  # past the embedding table
    with torch.inference_mode():
        assert lm.model.decode_logits(ids, pos, meta) is None
        assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))
        head = lm.model.lm_head
        lm.model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=False)
        assert lm.model.decode_logits(ids.clamp(max=5), pos, meta) is None
        assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))


def test_the_engine_decodes_through_the_one_call_step(model_dir, monkeypatch):
    """The runner takes the one-call path for decode-only steps, and fp32 greedy output stays transformers'."""
    from transformers import AutoModelForCausalLM

    from llmdeploy.engine import LLM, SamplingParams

    calls: list[bool] = []
    real = DecodeLayers.logits

    def spy(self, *args):
        out = real(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(DecodeLayers, "logits", spy)
    folder = model_dir("qwen2")
    llm = LLM(model=str(folder), dtype="float32", max_model_len=128, kv_cache_gb=0.01)
    prompts = [[3, 17, 42, 9, 88], list(range(10, 40))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for ids, out in zip(prompts, outs, strict=True):
        mask = torch.ones(1, len(ids), dtype=torch.long)
        ref = hf.generate(torch.tensor([ids]), attention_mask=mask, max_new_tokens=10, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(ids) :].tolist()
    assert (True in calls) == native_linear_for("float32", "none")
