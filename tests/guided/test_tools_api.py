"""Tool calling end to end on the local engine with the official openai SDK, streaming and not.

The tiny model's template knows no tools (the generic format); "required" and a named function are enforced
by constrained decoding, so even random weights produce well-formed calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

ALIAS = "tiny-chat"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather at a place",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("temperature, parallel", [(0.0, True), (1.0, False), (0.7, False)])
def test_required_choice_gives_valid_calls(oai, temperature, parallel):
    # sampled random weights may add parallel calls until max_tokens: one call is what can always finish
    resp = oai.chat.completions.create(
        model=ALIAS,
        messages=MSG,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=80,
        temperature=temperature,
        seed=4,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    check_calls(choice.message.tool_calls)


def test_named_choice_and_parallel_false(oai):
    resp = oai.chat.completions.create(
        model=ALIAS,
        messages=MSG,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=40,
        temperature=0,
    )
    (call,) = resp.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    check_calls([call])
    single = oai.chat.completions.create(
        model=ALIAS,
        messages=MSG,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=1.0,
        seed=9,
    )
    assert len(single.choices[0].message.tool_calls) == 1


def collect_stream(stream):
    """The SDK's chunks -> (role, content, calls by index, finish_reason), checking OpenAI's delta rules."""
    role, content, calls, finish = None, "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            role = role or d.role
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name, tc  # the head comes first
                    calls[tc.index] = {
                        "id": tc.id,
                        "name": tc.function.name,
                        "arguments": tc.function.arguments or "",
                    }
                else:
                    assert tc.id is None and tc.function.name is None
                    calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return role, content, calls, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_match_openai_deltas(oai, choice):
    kwargs = dict(model=ALIAS, messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=80, temperature=0)
    whole = oai.chat.completions.create(**kwargs)
    role, content, calls, finish = collect_stream(oai.chat.completions.create(**kwargs, stream=True))
    assert role == "assistant" and content == "" and finish == "tool_calls"
    expected = whole.choices[0].message.tool_calls
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in expected
    ]


def test_tool_results_round_trip(oai):
    first = oai.chat.completions.create(
        model=ALIAS, messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0
    )
    msg = first.choices[0].message
    history = [
        *MSG,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in msg.tool_calls]},
        *[{"role": "tool", "tool_call_id": c.id, "content": '{"temp_c": 21}'} for c in msg.tool_calls],
    ]
    second = oai.chat.completions.create(
        model=ALIAS, messages=history, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = oai.chat.completions.create(
        model=ALIAS, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert none.choices[0].message.tool_calls is None
