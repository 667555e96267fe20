"""Decode bursts (policies/decode_burst.py): a few plain-greedy or plain-sampled sequences decode several steps in
one native call, each token fed back in C. A burst must give exactly the tokens ordinary steps give (fp32: transformers' tokens),
stop where they stop, leave no block behind, and hand each request one output with all its new tokens."""

from __future__ import annotations

import pytest
import torch

from llmdeploy.engine import LLM, SamplingParams
from llmdeploy.engine.models import head_screen
from llmdeploy.kernels import cpu_native, native_build
from llmdeploy.kernels.decode_step import DecodeLayers
from tests.engine.test_models import hf_greedy, hf_model
from tests.helpers.tiny_models import make_tiny_model

PROMPTS = [[3, 17, 42, 9, 88], [5, 6], list(range(10, 40))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("burst"), "qwen2")


@pytest.fixture
def bursts(monkeypatch):
    """The steps of each burst that ran (DecodeLayers.greedy answers that were not None)."""
    ran: list[int] = []
    real = DecodeLayers.greedy

    def spy(self, *args):
        out = real(self, *args)
        if out is not None:
            ran.append(len(out[0]))
        return out

    monkeypatch.setattr(DecodeLayers, "greedy", spy)
    return ran


def native_for(dtype: str) -> bool:
    return native_build.library() is not None and (
        cpu_native.bf16_linear_available() if dtype == "bfloat16" else cpu_native.f32_linear_available()
    )


def engine(folder, dtype: str, burst: int) -> LLM:
    return LLM(model=str(folder), dtype=dtype, max_model_len=128, kv_cache_gb=0.01, decode_burst=burst)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_burst_gives_the_tokens_of_ordinary_steps(folder, bursts, dtype, batch, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)  # 1 + 4 + 4 + 2: a short last one
    monkeypatch.setenv(
        head_screen.ENV_SWITCH, "0"
    )  # no screened single greedy steps either: logits every step
    plain = [o.outputs[0].token_ids for o in engine(folder, dtype, 1).generate(PROMPTS[:batch], params)]
    assert not bursts
    monkeypatch.delenv(head_screen.ENV_SWITCH)
    burst = engine(folder, dtype, 4)
    got = [o.outputs[0].token_ids for o in burst.generate(PROMPTS[:batch], params)]
    assert got == plain
    assert (bursts == [4, 4, 2]) == native_for(dtype)
    bm = burst.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # the reserved blocks went back with the sequences


def test_fp32_greedy_through_bursts_is_transformers(folder, bursts):
    outs = engine(folder, "float32", 4).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    )
    hf = hf_model(folder)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, ids, 14) for ids in PROMPTS]
    assert bool(bursts) == native_for("float32")


def test_a_stop_inside_a_burst_ends_the_output_there(folder, bursts):
    """A stop token or stop string met by a burst's second token: the tokens after it are dropped, the finish is
    an ordinary step's."""
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = engine(folder, "float32", 1).generate([PROMPTS[0]], free)[0].outputs[0]
    stop_at = ref.token_ids[2]  # the burst's second token (the first came with the prefill)
    first = ref.token_ids.index(stop_at)
    llm = engine(folder, "float32", 4)
    by_id = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))
    out = by_id[0].outputs[0]
    assert out.token_ids == ref.token_ids[: first + 1] and out.finish_reason == "stop"
    text = llm.tokenizer.decode(ref.token_ids[: first + 1])
    if text.strip():
        by_text = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, stop=[text[-1]]))
        assert by_text[0].outputs[0].finish_reason == "stop"
        assert len(by_text[0].outputs[0].token_ids) <= first + 1
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bool(bursts) == native_for("float32")


def test_one_output_a_request_a_burst_and_only_for_plain_rows(folder, bursts):
    llm = engine(folder, "float32", 4)
    e = llm.engine
    e.stream = True
    e.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    deltas = []
    while e.has_unfinished():
        deltas += [len(o.outputs[0].delta_token_ids) for o in e.step()]
    assert deltas == ([1, 4, 4] if native_for("float32") else [1] * 9)
    bursts.clear()
    for params in (
        SamplingParams(temperature=0, max_tokens=6, logprobs=2),
        SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=6, min_tokens=6),
    ):
        llm.generate([PROMPTS[0]], params)
    assert not bursts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sampled_burst_draws_what_ordinary_steps_draw(folder, bursts, dtype):
    """Seeded sampled rows (temperature, min_p, top_k, top_p) burst: the same tokens as one step at a time, also
    beside a greedy row and after a row that stops inside a burst (each seeded generator ends where ordinary steps
    leave it: a request that goes on after a burst its neighbour cut short draws as it would have)."""
    cases = [
        SamplingParams(temperature=0.9, max_tokens=13, seed=3, ignore_eos=True),
        SamplingParams(temperature=1.4, min_p=0.05, max_tokens=13, seed=4, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
    ]
    plain = engine(folder, dtype, 1)
    ref = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, cases)]
    assert len(set(ref[0])) > 3 and not bursts
    got = [o.outputs[0].token_ids for o in engine(folder, dtype, 4).generate(PROMPTS, cases)]
    assert got == ref
    assert bool(bursts) == native_for(dtype)
    # top_p and top_k (with min_p) at the rows' temperatures, beside a plain sampled row: the burst filters and
    # draws as ordinary steps do (a burst without the filter draws other tokens here: checked by hand)
    filtered = [
        SamplingParams(temperature=1.7, top_p=0.6, max_tokens=13, seed=5, ignore_eos=True),
        SamplingParams(temperature=2.5, top_k=3, min_p=0.1, max_tokens=13, seed=6, ignore_eos=True),
        cases[0],
    ]
    bursts.clear()
    ref_f = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, filtered)]
    assert not bursts
    assert [o.outputs[0].token_ids for o in engine(folder, dtype, 4).generate(PROMPTS, filtered)] == ref_f
    assert bool(bursts) == native_for(dtype)
    # a stop met by the first row inside a burst: the others go on with their own draws
    stop_at = ref[0][3]
    first = ref[0].index(stop_at)
    stopping = [SamplingParams(temperature=0.9, max_tokens=13, seed=3, stop_token_ids=[stop_at]), *cases[1:]]
    ref_stop = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, stopping)]
    assert ref_stop[0] == ref[0][: first + 1] and ref_stop[1:] == ref[1:]
    assert [o.outputs[0].token_ids for o in engine(folder, dtype, 4).generate(PROMPTS, stopping)] == ref_stop


def test_a_burst_declines_a_table_too_narrow_and_writes_nothing(folder):
    llm = engine(folder, "float32", 4)
    if not native_for("float32"):
        return
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2))  # builds the native layers
    layers = llm.engine.runner.model.model.native_decode.layers
    caches = [c.clone() for layer in layers.layers for c in (layer.k_cache, layer.v_cache)]
    args = (torch.tensor([5]), torch.tensor([15]), llm.engine.runner.model.cos_sin_cache)
    one_block = torch.zeros(1, 1, dtype=torch.int32)
    assert layers.greedy(*args, one_block, torch.tensor([16], dtype=torch.int32), 2) is None  # position 16
    after = [c for layer in layers.layers for c in (layer.k_cache, layer.v_cache)]
    assert all(torch.equal(a, b) for a, b in zip(caches, after, strict=True))
    assert layers.greedy(*args, one_block, torch.tensor([16], dtype=torch.int32), 1) is not None


def test_an_arrival_or_an_abort_ends_a_burst_after_its_current_step(folder, bursts, monkeypatch):
    """The engine raises its yield flag when a prompt arrives or a request is aborted; the C loop reads it before
    each step after the first, so neither waits for the rest of a burst, and the tokens stay the ordinary ones."""
    free = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    ref = engine(folder, "float32", 1).generate([PROMPTS[0]], free)[0].outputs[0].token_ids
    llm = engine(folder, "float32", 4)
    e = llm.engine
    assert e.burst_yield.value == 0
    e.add_request("waits", [7, 8, 9], free)
    assert e.burst_yield.value == 1  # raised by the arrival
    assert e.abort("waits") and e.burst_yield.value == 1
    runner, real = e.runner, e.runner.run_burst

    def arrival_during(*args):
        e.burst_yield.value = 1  # as add_request would from the server's thread while the call runs
        return real(*args)

    monkeypatch.setattr(runner, "run_burst", arrival_during)
    got = llm.generate([PROMPTS[0]], free)[0].outputs[0].token_ids
    assert got == ref
    if native_for("float32"):
        assert bursts and all(n == 1 for n in bursts)  # each burst stopped after its first step
    # a seeded sampled request too: each cut burst drew for 4 steps and used 1, and its generator is rewound
    seeded = SamplingParams(temperature=1.1, max_tokens=9, seed=8, ignore_eos=True)
    monkeypatch.setattr(runner, "run_burst", real)
    want = engine(folder, "float32", 1).generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids
    monkeypatch.setattr(runner, "run_burst", arrival_during)
    bursts.clear()
    assert llm.generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids == want
    assert bool(bursts) == native_for("float32")


def test_the_ttft_model_waits_out_only_the_burst_step_under_way(folder):
    """While a burst runs, a new prompt would end it after its step under way: the queue view's remaining step
    time is what is left of that one step, not of the whole burst."""
    import time

    e = engine(folder, "float32", 4).engine
    step = e.cost.current().step_s(0.0, 1)
    with e.lock:
        e.step_shape, e.step_count = (0.0, 1), 4
        e.step_started = time.perf_counter() - 1.5 * step  # half-way through the burst's second step
        burst_left = e.queue_view().step_remaining_s
        e.step_count = 1
        e.step_started = time.perf_counter() - 0.5 * step  # half-way through an ordinary step
        step_left = e.queue_view().step_remaining_s
        e.step_started = None
    assert 0 < burst_left <= 0.55 * step and 0.4 * step <= step_left <= 0.55 * step
