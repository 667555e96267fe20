"""Greedy output of the engine == transformers' generate, token for token, on tiny random models. float32 on both
sides, named explicitly: `dtype: auto` is bfloat16 on CPUs with native bf16 matmuls."""

from __future__ import annotations

import random

import pytest
import torch

from llmdeploy.engine import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3"]
MAX_NEW = 24
_hf_cache: dict[tuple, list[int]] = {}


def prompts(
    n: int, seed: int = 0, lo: int = 3, hi: int = 60, prefix: list[int] | None = None
) -> list[list[int]]:
    r = random.Random(seed)
    return [(prefix or []) + [r.randrange(3, 400) for _ in range(r.randint(lo, hi))] for _ in range(n)]


def hf_greedy(path, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    key = (str(path), tuple(prompt), max_new)
    if key not in _hf_cache:
        from transformers import AutoModelForCausalLM

        model = _hf_models.get(str(path))
        if model is None:
            model = _hf_models[str(path)] = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32
            ).eval()
            model.generation_config.eos_token_id = None  # exactly max_new tokens, as ignore_eos
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new,
                do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )
        _hf_cache[key] = out[0, len(prompt) :].tolist()
    return _hf_cache[key]


_hf_models: dict = {}
BATCH = prompts(16, seed=2, lo=1, hi=90)  # shared by several tests: transformers' answers are computed once
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def assert_parity(llm: LLM, path, batch: list[list[int]], params=GREEDY) -> None:
    outs = llm.generate(batch, params)
    for p, out in zip(batch, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, p), f"prompt of {len(p)} tokens"
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("arch", ARCHS)
def test_single_requests(tiny_model, arch):
    path = tiny_model(arch)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gb=0.01)
    for p in prompts(3, seed=1):
        assert_parity(llm, path, [p])


@pytest.mark.parametrize("arch", ARCHS)
def test_sixteen_requests_of_different_lengths_batched(tiny_model, arch):
    path = tiny_model(arch)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gb=0.01)
    assert_parity(llm, path, BATCH)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_caching_shared_system_prompt(tiny_model, arch):
    path = tiny_model(arch)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gb=0.01, prefix_caching=True)
    system = prompts(1, seed=3, lo=40, hi=40)[0]
    batch = prompts(8, seed=4, lo=2, hi=20, prefix=system)
    assert_parity(llm, path, batch[:1])  # warms the cache
    hits = llm.engine.block_manager.num_hits
    assert_parity(llm, path, batch[1:])
    assert (
        llm.engine.block_manager.num_hits - hits >= 7 * 32
    )  # two full 16-token blocks of the system prompt each
    assert llm.engine.stats().prefix_cache_queries > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_forced_small(tiny_model, arch):
    path = tiny_model(arch)
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=256,
        kv_cache_gb=0.01,
        max_num_batched_tokens=16,
        block_size=16,
    )
    assert_parity(llm, path, BATCH[::3])


@pytest.mark.parametrize("arch", ARCHS)
def test_under_preemption(tiny_model, arch):
    path = tiny_model(arch)
    # a tiny cache: 16 requests cannot all hold their blocks at once
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, kv_cache_gb=0.00024, prefix_caching=False)
    assert llm.engine.block_manager.num_blocks < 40
    assert_parity(llm, path, BATCH)
    assert llm.engine.stats().num_preemptions > 0


def test_prefix_caching_with_preemption_and_small_chunks(tiny_model):
    path = tiny_model("llama")
    llm = LLM(
        model=str(path), dtype="float32", max_model_len=128, kv_cache_gb=0.00012, max_num_batched_tokens=16
    )
    system = prompts(1, seed=7, lo=33, hi=33)[0]
    assert_parity(llm, path, prompts(16, seed=8, lo=5, hi=30, prefix=system))
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_long_context_decodes_next_to_short_ones(tiny_llama, monkeypatch):
    """The torch gather path of the decode op (no C compiler) pads to the longest context of the batch; a long
    context among short ones runs apart. The short requests arrive once the long one decodes, so that they share
    decode steps whatever the scheduler's prefill order."""
    from llmdeploy.kernels import native_build, reference

    monkeypatch.setattr(native_build, "library", lambda: None)
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=1024, kv_cache_gb=0.02)
    engine = llm.engine
    long_prompt, short = prompts(1, seed=10, lo=600, hi=600)[0], prompts(6, seed=11, lo=5, hi=30)
    batches, apart = [], []
    decode, one = reference.paged_attention_decode, reference.decode_one_sequence
    monkeypatch.setattr(
        reference, "paged_attention_decode", lambda q, *a: batches.append(q.shape[0]) or decode(q, *a)
    )
    monkeypatch.setattr(
        reference, "decode_one_sequence", lambda q, *a: apart.append((batches[-1], a[3])) or one(q, *a)
    )
    engine.add_request("long", long_prompt, GREEDY)
    while not any(s.num_output_tokens for s in engine.scheduler.running):
        engine.step()
    for i, p in enumerate(short):
        engine.add_request(f"short-{i}", p, GREEDY)
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert done["long"] == hf_greedy(tiny_llama, long_prompt)
    assert [done[f"short-{i}"] for i in range(6)] == [hf_greedy(tiny_llama, p) for p in short]
    assert any(size >= 6 and n > 600 for size, n in apart)  # the long one left a batch of 6 or more


def test_all_blocks_free_after_generate(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_gb=0.01)
    llm.generate(prompts(5, seed=9), GREEDY)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_text_prompts_and_chat(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_gb=0.01)
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    ids = llm.tokenizer.encode("Hello world")
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == hf_greedy(tiny_llama, ids, 8)
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    chat = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=4))[0]
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)


def test_metrics_timestamps_are_ordered(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_gb=0.01)
    m = llm.generate([[5, 6, 7]], GREEDY)[0].metrics
    assert (
        m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    )


def test_the_first_request_is_served_over_the_block_touched_at_start(tiny_model):
    """At start the runner writes one short prefill into the cache's first block (its pages' first touch is paid
    then, not by the first request); the first request gets that block and its output is still transformers'."""
    path = tiny_model("llama")
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gb=0.01)
    kv = llm.engine.runner.kv_cache
    assert kv[:, :, 0].abs().sum() > 0 and kv[:, :, 1:].abs().sum() == 0
    assert next(iter(llm.engine.block_manager.free_plain)) == 0  # the first request's first block
    assert_parity(llm, path, prompts(1, seed=9, lo=20, hi=40))
