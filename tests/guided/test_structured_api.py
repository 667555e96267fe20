"""Structured output on the local engine, through HTTP and the official openai SDK, over a tiny random model:
random weights write garbage, which constrained decoding must turn into JSON that parses and validates."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from tests.guided.schemas import SCHEMAS

ALIAS = "tiny-chat"
MSG = [{"role": "user", "content": "Give me the data as JSON."}]


def schema_request(oai, schema: dict, temperature: float, seed: int):
    return oai.chat.completions.create(
        model=ALIAS,
        messages=MSG,
        max_tokens=96,
        temperature=temperature,
        seed=seed,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": schema, "strict": True},
        },
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_gives_valid_json_or_stops_at_the_length_limit(oai, temperature):
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(lambda i: schema_request(oai, SCHEMAS[i], temperature, i), range(len(SCHEMAS)))
        )
    completed = 0
    for schema, resp in zip(SCHEMAS, answers, strict=True):
        choice = resp.choices[0]
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
            completed += 1
    assert completed >= len(SCHEMAS) // 2, f"only {completed} of {len(SCHEMAS)} finished"


def test_json_object_and_guided_fields(oai):
    resp = oai.chat.completions.create(
        model=ALIAS, messages=MSG, max_tokens=64, seed=1, response_format={"type": "json_object"}
    )
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    regex = oai.completions.create(
        model=ALIAS, prompt="Code:", max_tokens=20, seed=2, extra_body={"guided_regex": "[A-C]{2}-[0-9]{3}"}
    )
    assert regex.choices[0].finish_reason == "stop"
    assert re.fullmatch("[A-C]{2}-[0-9]{3}", regex.choices[0].text)
    choice = oai.chat.completions.create(
        model=ALIAS, messages=MSG, max_tokens=20, seed=3, extra_body={"guided_choice": ["yes", "no", "a.b*"]}
    )
    assert choice.choices[0].message.content in ("yes", "no", "a.b*")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    gj = oai.completions.create(
        model=ALIAS, prompt="JSON:", max_tokens=40, temperature=0, extra_body={"guided_json": schema}
    )
    if gj.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(gj.choices[0].text), schema)


def test_streamed_json_is_the_same_as_the_whole_answer(oai):
    schema = SCHEMAS[1]
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    whole = oai.chat.completions.create(
        model=ALIAS, messages=MSG, max_tokens=80, temperature=0, response_format=rf
    )
    parts = oai.chat.completions.create(
        model=ALIAS, messages=MSG, max_tokens=80, temperature=0, response_format=rf, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert text == whole.choices[0].message.content


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            },
            "messages",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_structured_requests_are_400_naming_the_param(engine_url, body, param):
    payload = {"model": ALIAS, "messages": MSG, "max_tokens": 4, **body}
    r = httpx.post(f"{engine_url}/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
