"""The official `openai` SDK against a real engine server process: what users point at us must just work."""

from __future__ import annotations

import openai
import pytest

from tests.engine.test_server import ALIAS, CHAT, MAX_MODEL_LEN


@pytest.fixture(scope="module")
def sdk(shared_engine):
    _, url = shared_engine()
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def test_models(sdk):
    assert [m.id for m in sdk.models.list()] == [ALIAS]


def test_chat(sdk):
    resp = sdk.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=8, temperature=0)
    assert resp.object == "chat.completion" and resp.model == ALIAS
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert (
        resp.usage.prompt_tokens > 0
        and resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    )


def test_completions_max_tokens_gives_length(sdk):
    resp = sdk.completions.create(
        model=ALIAS,
        prompt="The quick brown fox",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 6


def test_chat_streaming_with_usage(sdk):
    kwargs = dict(model=ALIAS, messages=CHAT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = sdk.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(sdk.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions_streaming(sdk):
    kwargs = dict(
        model=ALIAS, prompt="Hello world", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    full = sdk.completions.create(**kwargs).choices[0].text
    chunks = list(sdk.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_and_logprobs(sdk):
    resp = sdk.chat.completions.create(
        model=ALIAS,
        messages=CHAT,
        max_tokens=3,
        n=2,
        temperature=0.8,
        seed=7,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in resp.choices] == [0, 1]
    for c in resp.choices:
        assert len(c.logprobs.content) == 3
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)
    legacy = sdk.completions.create(model=ALIAS, prompt="Hello", max_tokens=2, logprobs=2, temperature=0)
    assert len(legacy.choices[0].logprobs.tokens) == len(legacy.choices[0].logprobs.token_logprobs)


def test_stop_string_is_not_leaked(sdk):
    kwargs = dict(
        model=ALIAS,
        prompt="The quick brown fox",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = sdk.completions.create(**kwargs).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    chunks = list(sdk.completions.create(**kwargs, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_errors_arrive_as_sdk_exceptions(sdk):
    with pytest.raises(openai.NotFoundError) as e:
        sdk.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=ALIAS, prompt="hello " * 1000, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=ALIAS, prompt="hello", max_tokens=MAX_MODEL_LEN)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=ALIAS, messages=CHAT, temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=ALIAS, messages=CHAT, stream=True, max_tokens=MAX_MODEL_LEN * 2)
    assert e.value.code == "context_length_exceeded"
