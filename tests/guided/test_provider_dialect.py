"""The cloud's dialect translated to OpenAI's shapes (router/provider.py), without a server."""

from __future__ import annotations

import json

from llmdeploy.router.provider import StreamState, normalize_response, translate_request


def test_guided_json_becomes_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    out = translate_request({"model": "m", "guided_json": json.dumps(schema), "guided_regex": "x", "n": 1})
    assert out["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": schema, "strict": True},
    }
    assert "guided_json" not in out and "guided_regex" not in out and out["n"] == 1
    kept = translate_request({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}})
    assert kept["response_format"] == {"type": "json_object"}


def test_legacy_function_call_and_loose_calls():
    legacy = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "function_call",
                "message": {
                    "role": "assistant",
                    "content": "",
                    "function_call": {"name": "f", "arguments": {"x": 1}},
                },
            }
        ]
    }
    msg = normalize_response(legacy, False)["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["content"] is None
    (call,) = msg["message"]["tool_calls"]
    assert (
        call["type"] == "function"
        and call["id"].startswith("call_")
        and json.loads(call["function"]["arguments"]) == {"x": 1}
    )
    assert "function_call" not in msg["message"]
    loose = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]},
            }
        ]
    }
    c = normalize_response(loose, False)["choices"][0]
    assert (
        c["finish_reason"] == "tool_calls" and c["message"]["tool_calls"][0]["function"]["arguments"] == "{}"
    )


def test_fenced_json_is_unwrapped_only_in_json_mode():
    body = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": '```json\n{"a": 1}\n```'},
            }
        ]
    }
    assert (
        normalize_response(json.loads(json.dumps(body)), True)["choices"][0]["message"]["content"]
        == '{"a": 1}'
    )
    assert normalize_response(body, False)["choices"][0]["message"]["content"].startswith("```")


def test_stream_deltas_get_ids_indices_and_the_finish_reason():
    st = StreamState(False)
    chunks = [
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "", "tool_calls": [{"function": {"name": "f"}}]},
                    "finish_reason": None,
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"function": {"arguments": '{"x"'}}]},
                    "finish_reason": None,
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"function": {"arguments": ": 1}"}}]},
                    "finish_reason": None,
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"function_call": {"name": "g", "arguments": ""}},
                    "finish_reason": None,
                }
            ]
        },
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    out = [st.chunk(c)["choices"][0] for c in chunks]
    head = out[0]["delta"]["tool_calls"][0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "f", "arguments": ""} and out[0]["delta"]["content"] is None
    args = "".join(o["delta"]["tool_calls"][0]["function"]["arguments"] for o in out[1:3])
    assert args == '{"x": 1}' and all(o["delta"]["tool_calls"][0]["index"] == 0 for o in out[1:3])
    second = out[3]["delta"]["tool_calls"][0]
    assert (
        second["index"] == 1 and second["function"]["name"] == "g" and "function_call" not in out[3]["delta"]
    )
    assert out[4]["finish_reason"] == "tool_calls"
