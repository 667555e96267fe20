"""echo with logprobs (prompt logprobs): each prompt token's logprob equals transformers' on the same weights, in
chunked prefill too, and the HTTP answer has OpenAI's legacy shape (the first prompt token's logprob null)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from llmdeploy.engine import LLM, SamplingParams
from tests.engine.test_server import ALIAS

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7, 250, 31] * 4  # 40 tokens: two 16-token chunks and a rest


def hf_prompt_logprobs(path, ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


@pytest.mark.parametrize("budget", [16, 2048])  # chunked prefill, and the whole prompt in one step
def test_prompt_logprobs_match_transformers(tiny_llama, budget):
    llm = LLM(
        model=str(tiny_llama),
        dtype="float32",
        max_model_len=256,
        kv_cache_gb=0.01,
        max_num_batched_tokens=budget,
    )
    params = SamplingParams(max_tokens=2, prompt_logprobs=3, logprobs=1, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params)
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(PROMPT) and lps[0] is None
    assert [lp.token_id for lp in lps[1:]] == PROMPT[1:]
    ref = hf_prompt_logprobs(tiny_llama, PROMPT)
    assert [lp.logprob for lp in lps[1:]] == pytest.approx(ref, abs=1e-4)
    assert all(len(lp.top) == 3 and lp.top[0][1] >= lp.logprob - 1e-6 for lp in lps[1:])


def test_prompt_logprobs_are_not_cut_short_by_the_prefix_cache(tiny_llama):
    llm = LLM(
        model=str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_gb=0.01, prefix_caching=True
    )
    llm.generate([PROMPT], SamplingParams(max_tokens=1))  # the prompt's blocks are now cached
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert len(out.prompt_logprobs) == len(PROMPT) and out.num_cached_tokens == 0


@pytest.fixture(scope="module")
def url(shared_engine):
    return shared_engine()[1]


def test_echo_with_logprobs_over_http_in_openais_shape(url):
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = PROMPT[:12]
    out = api.completions.create(
        model=ALIAS, prompt=prompt, max_tokens=3, echo=True, logprobs=2, temperature=0
    )
    lp = out.choices[0].logprobs
    n = len(prompt) + out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:]) and lp.text_offset == sorted(lp.text_offset)
    assert out.choices[0].text.startswith("".join(lp.tokens[: len(prompt)]))
    body = {"model": ALIAS, "prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: {"))
    chunk = json.loads(first[6:])["choices"][0]
    assert chunk["logprobs"]["token_logprobs"][0] is None and len(chunk["logprobs"]["tokens"]) >= len(prompt)
