"""Chat messages -> prompt token ids through the model's own chat template (from the same source as the weights).

Tools are rendered by the template itself (`apply_chat_template(tools=...)`) when it knows them; a template
that does not (SmolLM2, the tiny test models) gets them in a system message that asks for the hermes form
(engine/tool_calls.py). Assistant calls and `role: tool` answers in the history are passed in the shape HF
templates read: `tool_calls` with arguments as a mapping, `tool_call_id` on the answer.
"""

from __future__ import annotations

import json
from typing import Any

from llmdeploy.engine.tool_calls import HERMES_CLOSE, HERMES_OPEN, template_renders_tools
from llmdeploy.openai_api.errors import invalid_request
from llmdeploy.openai_api.schemas import ChatMessage

GENERIC_TOOLS_PROMPT = (
    "You can call functions. To call one, answer with {open}"
    '{{"name": <function name>, "arguments": <arguments as a JSON object>}}{close} and nothing else.\n'
    "Functions:\n{functions}"
)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _arguments(value: str | dict[str, Any]) -> dict[str, Any] | str:
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if isinstance(parsed, dict) else value


def _hf_message(m: ChatMessage, inline_calls: bool) -> dict[str, Any]:
    """One message as HF templates read it. inline_calls: the template knows no tool calls, so an assistant's
    calls are written into its text in the form the system prompt asked for."""
    msg: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        msg["name"] = m.name
    if m.tool_call_id:
        msg["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
        if inline_calls:
            text = "".join(
                f"{HERMES_OPEN}{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
                f"{HERMES_CLOSE}"
                for c in calls
            )
            msg["content"] = (msg["content"] + "\n" + text).strip()
        else:
            msg["tool_calls"] = calls
    return msg


def _with_tools_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    functions = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    prompt = GENERIC_TOOLS_PROMPT.format(open=HERMES_OPEN, close=HERMES_CLOSE, functions=functions)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}".strip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def render_chat(
    tokenizer: Any, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None
) -> str:
    """The prompt text the model was trained to continue: the template with an open assistant turn."""
    if not has_chat_template(tokenizer):
        raise invalid_request(
            "This model has no chat template; use /v1/completions with a plain prompt instead.",
            param="messages",
            code="chat_template_missing",
        )
    if any(m.has_images for m in messages):
        raise invalid_request(
            "This model does not accept images; send text content only.",
            param="messages",
            code="unsupported_content",
        )
    native = template_renders_tools(tokenizer)
    plain = [_hf_message(m, inline_calls=not native) for m in messages]
    kwargs: dict[str, Any] = {}
    if tools and native:
        kwargs["tools"] = tools
    elif tools:
        plain = _with_tools_prompt(plain, tools)
    try:
        return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as exc:  # templates raise their own errors (e.g. "roles must alternate")
        raise invalid_request(f"The chat template rejected these messages: {exc}", param="messages") from None


def chat_prompt_ids(
    tokenizer: Any, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    # the template already writes BOS and other special tokens as text; encoding must not add them twice
    return list(tokenizer.encode(render_chat(tokenizer, messages, tools), add_special_tokens=False))


def text_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    return list(tokenizer.encode(prompt, add_special_tokens=True))
