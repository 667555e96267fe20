"""Reading tool calls back from model text (hermes, Llama 3 JSON, generic) and streaming them as OpenAI does."""

from __future__ import annotations

import json

import pytest

from llmdeploy.engine.chat import render_chat
from llmdeploy.engine.tool_calls import ToolPlan, ToolStreamer, detect_tool_format, parse_output
from llmdeploy.openai_api.schemas import ChatMessage

NAMES = ("get_weather", "get_time")
# the shape of Qwen2.5's template: tools in the system turn, calls and answers as <tool_call>/<tool_response>
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>\nReturn calls in <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA_LIKE = (
    "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}ipython <|python_tag|>{% endif %}"
)


class Tok:
    def __init__(self, template: str | None):
        self.chat_template = template

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, tools=None):
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
        )
        return rendered[0]


def plan(fmt, mode="auto", named=None, parallel=True):
    return ToolPlan(mode, fmt, NAMES, named, parallel)


def test_format_follows_the_template():
    assert detect_tool_format(Tok(QWEN_LIKE)) == "hermes"
    assert detect_tool_format(Tok(LLAMA_LIKE)) == "llama3_json"
    assert detect_tool_format(Tok("{{ messages }}")) == "generic"


def test_hermes_calls_and_content():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    p = parse_output(plan("hermes"), text)
    assert p.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in p.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in p.tool_calls}) == 2
    assert len(parse_output(plan("hermes", parallel=False), text).tool_calls) == 1


@pytest.mark.parametrize(
    "text",
    [
        "plain answer",
        '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": </tool_call>',
    ],
)
def test_text_that_is_not_a_call_stays_content(text):
    p = parse_output(plan("hermes"), text)
    assert p.tool_calls == [] and p.content == text


def test_llama3_json_calls():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {"zone": "UTC"}}'
    p = parse_output(plan("llama3_json"), text)
    assert [c.name for c in p.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(p.tool_calls[1].arguments) == {"zone": "UTC"}
    assert parse_output(plan("llama3_json"), '{"answer": 42}').tool_calls == []


def test_required_and_named_forms():
    req = parse_output(plan("generic", "required"), '[{"name":"get_time","arguments":{"zone":"CET"}}]')
    assert req.content is None and req.tool_calls[0].name == "get_time"
    named = parse_output(plan("generic", "named", "get_weather"), '{"city":"Paris"}')
    assert named.tool_calls[0].name == "get_weather" and named.tool_calls[0].arguments == '{"city":"Paris"}'


def assemble(deltas):
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls", []):
            if tc["index"] not in calls:
                assert tc["id"] and tc["type"] == "function" and tc["function"]["arguments"] == ""
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            else:
                assert "id" not in tc and "name" not in tc["function"]
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_streamer_holds_calls_and_streams_content(cut):
    text = 'Sure <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    s = ToolStreamer(plan("hermes"))
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    deltas = []
    for i, piece in enumerate(pieces):
        deltas += s.feed(piece, i == len(pieces) - 1)
    content, calls = assemble(deltas)
    assert content == "Sure "
    assert calls == {0: {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    assert s.finish_reason("stop") == "tool_calls"
    assert "<" not in content  # the marker's start was held back, never sent as content


def test_streamer_plain_text_and_named_arguments():
    s = ToolStreamer(plan("hermes"))
    out = s.feed("Hello <tool", False) + s.feed("s are fun", True)
    assert assemble(out)[0] == "Hello <tools are fun" and s.finish_reason("stop") == "stop"
    n = ToolStreamer(plan("generic", "named", "get_time"))
    out = n.feed('{"zone"', False) + n.feed(': "UTC"}', True)
    assert assemble(out)[1] == {0: {"name": "get_time", "arguments": '{"zone": "UTC"}'}}


def test_template_renders_tools_and_history():
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    history = [
        ChatMessage(role="user", content="time?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
                    }
                ],
            }
        ),
        ChatMessage(role="tool", content="12:00", tool_call_id="call_1"),
    ]
    text = render_chat(Tok(QWEN_LIKE), history, tools)
    assert '"name": "get_time"' in text and "<tools>" in text  # the template's own rendering of the tools
    assert (
        '<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}' in text or '"zone": "UTC"' in text
    )
    generic = render_chat(
        Tok("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"), history, tools
    )
    assert (
        generic.startswith("[system] You can call functions") and '<tool_call>{"name": "get_time"' in generic
    )
