"""Tool calling: which text format the loaded model writes calls in, how its output is read back into
OpenAI's `tool_calls`, and the streaming deltas OpenAI sends for them.

Formats, chosen from the model's own chat template (the template is what taught the model the format):
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Qwen2, Qwen2.5,
  Qwen3, Hermes);
- llama3_json: a bare `{"name": ..., "parameters": {...}}` object, calls separated by `;`, optionally after
  `<|python_tag|>` (Llama 3.1-3.3);
- generic: templates that know no tools (SmolLM2, the tiny test models); the tools are described in a system
  message asking for the hermes form, and a bare JSON call object is read too.
`tool_choice` "required" and a named function do not rely on the model: constrained decoding makes the output
a JSON call list (required) or the named function's arguments object, read back here whatever the format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

ToolFormat = Literal["hermes", "llama3_json", "generic"]
ToolMode = Literal["auto", "required", "named"]
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def detect_tool_format(tokenizer: Any) -> ToolFormat:
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if HERMES_OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or ("ipython" in template and "tools" in template):
        return "llama3_json"
    return "generic"


def template_renders_tools(tokenizer: Any) -> bool:
    return "tools" in str(getattr(tokenizer, "chat_template", None) or "")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request's output is read: the mode, the model's format, the tools' names."""

    mode: ToolMode
    fmt: ToolFormat
    names: tuple[str, ...]
    named: str | None = None
    parallel: bool = True


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Parsed:
    content: str | None
    tool_calls: list[ToolCall]


# ---- the constrained forms ----------------------------------------------------------------------------------


def function_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = (tool.get("function") or {}).get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """tool_choice "required": a list of one call (more with parallel_tool_calls) to any of the tools."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": function_parameters(t),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# ---- reading the output -------------------------------------------------------------------------------------


def _args_text(value: Any) -> str | None:
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            return None
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return None


def _call_from(obj: Any, names: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = _args_text(args)
    return None if text is None else ToolCall(obj["name"], text)


def _json_objects(text: str) -> list[Any] | None:
    """`{...}` or `{...}; {...}` (Llama 3's parallel form) -> the objects; None if it is not only that."""
    decoder, objs, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            return None
        objs.append(obj)
        i = end
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
    return objs or None


def parse_hermes(text: str, names: tuple[str, ...]) -> Parsed | None:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return None
    calls = []
    for m in _HERMES_BLOCK.finditer(text, start):
        objs = _json_objects(m.group(1)) or []
        calls += [c for c in (_call_from(o, names) for o in objs) if c is not None]
    if not calls:
        return None
    content = text[:start].strip()
    return Parsed(content or None, calls)


def parse_bare_json(text: str, names: tuple[str, ...]) -> Parsed | None:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :]
    objs = _json_objects(body)
    if not objs:
        return None
    calls = [_call_from(o, names) for o in objs]
    if any(c is None for c in calls):
        return None
    return Parsed(None, calls)  # type: ignore[arg-type]


def parse_output(plan: ToolPlan, text: str) -> Parsed:
    """The model's text -> content and tool calls; text that is not a well-formed call stays content."""
    if plan.mode == "named":
        return Parsed(None, [ToolCall(plan.named or "", text)])
    if plan.mode == "required":
        try:
            data = json.loads(text)
        except ValueError:
            return Parsed(text, [])
        calls = [_call_from(o, plan.names) for o in data] if isinstance(data, list) else []
        good = [c for c in calls if c is not None]
        return Parsed(None, good) if good else Parsed(text, [])
    found = None
    if plan.fmt in ("hermes", "generic"):
        found = parse_hermes(text, plan.names)
    if found is None and plan.fmt in ("llama3_json", "generic"):
        found = parse_bare_json(text, plan.names)
    if found is None:
        return Parsed(text, [])
    if not plan.parallel:
        found.tool_calls = found.tool_calls[:1]
    return found


def finish_reason(parsed: Parsed, engine_reason: str | None) -> str | None:
    return "tool_calls" if parsed.tool_calls and engine_reason == "stop" else engine_reason


# ---- streaming ------------------------------------------------------------------------------------------------


def call_deltas(calls: list[ToolCall], first_index: int = 0) -> list[dict[str, Any]]:
    """OpenAI's deltas for whole calls: the head (id, type, name, empty arguments), then the arguments."""
    out = []
    for i, c in enumerate(calls, first_index):
        head = {"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
        out.append({"tool_calls": [head]})
        if c.arguments:
            out.append({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]})
    return out


class ToolStreamer:
    """One choice's stream: text deltas in, OpenAI delta objects out. Content streams as usual until the
    output could be a call; a call is held until it is complete (its end, or the end of the output), then
    sent as a head and an arguments delta. A named function's arguments stream as they come."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""  # everything so far
        self.sent = 0  # characters of text already sent as content
        self.holding = plan.mode == "required"
        self.named_call: ToolCall | None = None
        self.calls: list[ToolCall] = []

    def feed(self, delta: str, finished: bool) -> list[dict[str, Any]]:
        self.text += delta
        if self.plan.mode == "named":
            return self._named(delta)
        out: list[dict[str, Any]] = []
        if not self.holding:
            start = self._call_start()
            safe = len(self.text) if start is None else start
            if start is None and not finished:
                safe = len(self.text) - self._partial_marker()
            if safe > self.sent:
                out.append({"content": self.text[self.sent : safe]})
                self.sent = safe
            self.holding = start is not None
        if finished and self.holding:
            rest = self.text[self.sent :]
            parsed = parse_output(self.plan, rest)
            if parsed.tool_calls:
                if parsed.content:
                    out.append({"content": parsed.content})
                self.calls = parsed.tool_calls
                out += call_deltas(parsed.tool_calls)
            elif rest:
                out.append({"content": rest})
            self.sent = len(self.text)
        return out

    def _named(self, delta: str) -> list[dict[str, Any]]:
        out = []
        if self.named_call is None:
            self.named_call = ToolCall(self.plan.named or "", "")
            self.calls = [self.named_call]
            out += call_deltas([self.named_call])
        if delta:
            self.named_call.arguments += delta
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
        return out

    def _call_start(self) -> int | None:
        """Where a call begins in the text, if one does."""
        text = self.text
        if self.plan.fmt in ("hermes", "generic"):
            i = text.find(HERMES_OPEN, self.sent)
            if i >= 0:
                return i
        if self.plan.fmt in ("llama3_json", "generic") and self.sent == 0:
            stripped = text.lstrip()
            if stripped.startswith("{") or stripped.startswith(PYTHON_TAG):
                return 0
        return None

    def _partial_marker(self) -> int:
        """Characters at the end that may be the start of a call marker (held back, as stop strings are)."""
        tail = self.text[self.sent :]
        if self.plan.fmt != "llama3_json":
            for k in range(min(len(HERMES_OPEN) - 1, len(tail)), 0, -1):
                if HERMES_OPEN.startswith(tail[-k:]):
                    return k
        if self.sent == 0 and not tail.strip():
            return len(tail)  # only whitespace so far: a bare JSON call may still follow
        return 0

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason
