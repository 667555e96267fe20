"""logit_bias, logprobs, best_of, seed and stop as OpenAI documents them, through the openai SDK."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import httpx
from transformers import AutoTokenizer

ALIAS = "tiny-chat"
MSG = [{"role": "user", "content": "Hello world! How are you today?"}]


def test_logit_bias_forces_and_bans(oai, tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    target = tok.encode(" fox", add_special_tokens=False)[-1]
    forced = oai.completions.create(
        model=ALIAS, prompt="The quick", max_tokens=5, temperature=0, logit_bias={str(target): 100}
    )
    assert forced.choices[0].text == tok.decode([target]) * 5
    free = oai.completions.create(model=ALIAS, prompt="The quick", max_tokens=8, temperature=0)
    first = tok.encode(free.choices[0].text, add_special_tokens=False)[0]
    banned = oai.completions.create(
        model=ALIAS, prompt="The quick", max_tokens=8, temperature=0, logit_bias={str(first): -100}
    )
    assert first not in tok.encode(banned.choices[0].text, add_special_tokens=False)


def test_chat_logprobs_shape(oai):
    resp = oai.chat.completions.create(
        model=ALIAS, messages=MSG, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0 and isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy: the chosen token is the best one
    streamed = oai.chat.completions.create(
        model=ALIAS, messages=MSG, max_tokens=4, temperature=0, logprobs=True, top_logprobs=1, stream=True
    )
    tokens = [
        t.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert tokens == [t.token for t in content]


def test_best_of_returns_the_most_likely_of_its_samples(oai):
    kwargs = dict(model=ALIAS, prompt="The quick brown", max_tokens=6, temperature=1.0, seed=11)
    pool = oai.completions.create(**kwargs, n=4, logprobs=0)
    totals = [sum(c.logprobs.token_logprobs) for c in pool.choices]
    best = oai.completions.create(**kwargs, n=1, best_of=4)
    assert len(best.choices) == 1 and best.choices[0].index == 0 and best.choices[0].logprobs is None
    assert best.choices[0].text == pool.choices[max(range(4), key=totals.__getitem__)].text
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in pool.choices)


def test_seed_reproduces_with_other_traffic_in_between(oai):
    kwargs = dict(model=ALIAS, messages=MSG, max_tokens=12, temperature=1.0, seed=1234, n=2)
    first = oai.chat.completions.create(**kwargs)
    with ThreadPoolExecutor(4) as pool:  # unseeded traffic batched alongside must not change it
        noise = [
            pool.submit(oai.chat.completions.create, model=ALIAS, messages=MSG, max_tokens=12)
            for _ in range(3)
        ]
        again = oai.chat.completions.create(**kwargs)
        [f.result() for f in noise]
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]
    other = oai.chat.completions.create(**{**kwargs, "seed": 4321})
    assert [c.message.content for c in other.choices] != [c.message.content for c in first.choices]


def test_stop_across_token_boundaries(oai, tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    free = oai.completions.create(model=ALIAS, prompt="Paris is", max_tokens=16, temperature=0)
    ids = tok.encode(free.choices[0].text, add_special_tokens=False)
    pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    # a stop string made of the end of one token and the start of the next
    k = next(
        i for i in range(1, len(ids)) if len(pieces[i - 1]) >= 1 and len(pieces[i]) - len(pieces[i - 1]) >= 2
    )
    stop = pieces[k][len(pieces[k - 1]) - 1 : len(pieces[k - 1]) + 1]
    cut = oai.completions.create(model=ALIAS, prompt="Paris is", max_tokens=16, temperature=0, stop=[stop])
    full = free.choices[0].text
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].stop_reason == stop
    assert cut.choices[0].text == full[: full.index(stop)]
    parts = oai.completions.create(
        model=ALIAS, prompt="Paris is", max_tokens=16, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in parts if c.choices) == cut.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(engine_url):
    r = httpx.post(
        f"{engine_url}/v1/completions",
        json={"model": ALIAS, "prompt": "Hi there", "echo": True, "logprobs": 1, "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and all(math.isfinite(x) for x in lp["token_logprobs"][1:])
