"""The cloud's dialect, translated at the HTTP transport of the cloud client, so the relay sees OpenAI's shapes
whatever answered.

Out: vLLM's `guided_json` becomes OpenAI's `response_format` json_schema (providers know only that one), the
other guided_* fields are dropped (routing never sends them to a cloud that lacks them), and the answer is asked
for uncompressed (this layer reads it).
In: tool calls in any of the shapes providers use become OpenAI's: a legacy `function_call` (Qianfan v1/ERNIE)
becomes `tool_calls`, arguments given as an object become JSON text, missing call ids, types and stream indices
are filled in, `content: ""` beside calls becomes null and the finish reason `tool_calls`; a JSON-mode answer
wrapped in a ```json fence is unwrapped.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_FENCE = re.compile(r"^\s*```(?:json)?\s*\n(.*?)\n?```\s*$", re.S)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- requests -----------------------------------------------------------------------------------------------


def translate_request(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in GUIDED_FIELDS}
    schema = body.get("guided_json")
    if schema is not None and "response_format" not in body:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                schema = None
        if isinstance(schema, dict):
            out["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "response", "schema": schema, "strict": True},
            }
    return out


def wants_json(body: dict[str, Any]) -> bool:
    rf = body.get("response_format")
    return isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema")


# ---- answers ------------------------------------------------------------------------------------------------


def _arguments(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def _tool_call(call: Any, index: int | None, stream: bool) -> dict[str, Any]:
    call = dict(call) if isinstance(call, dict) else {}
    fn = dict(call.get("function") or {})
    if "arguments" in fn:
        fn["arguments"] = _arguments(fn["arguments"])
    elif not stream:
        fn["arguments"] = "{}"
    call["function"] = fn
    if not stream:
        call.setdefault("id", _call_id())
        call["type"] = call.get("type") or "function"
    if stream and index is not None:
        call.setdefault("index", index)
    return call


def _unfence(text: Any) -> Any:
    if isinstance(text, str) and (m := _FENCE.match(text)):
        return m.group(1)
    return text


def normalize_message(msg: dict[str, Any], json_mode: bool) -> bool:
    """In place; True when the message carries tool calls."""
    legacy = msg.pop("function_call", None)
    if legacy and not msg.get("tool_calls"):
        msg["tool_calls"] = [{"type": "function", "function": legacy}]
    calls = msg.get("tool_calls")
    if calls:
        msg["tool_calls"] = [_tool_call(c, None, stream=False) for c in calls]
        if not msg.get("content"):
            msg["content"] = None
        return True
    msg.pop("tool_calls", None)
    if json_mode:
        msg["content"] = _unfence(msg.get("content"))
    return False


def _finish(choice: dict[str, Any], has_calls: bool) -> None:
    reason = choice.get("finish_reason")
    if reason == "function_call" or (has_calls and reason == "stop"):
        choice["finish_reason"] = "tool_calls"


def normalize_response(data: Any, json_mode: bool) -> Any:
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        return data
    for choice in data["choices"]:
        msg = choice.get("message") if isinstance(choice, dict) else None
        if isinstance(msg, dict):
            _finish(choice, normalize_message(msg, json_mode))
    return data


class StreamState:
    """Per stream: which choices called tools, and the next call index per choice (providers that send
    one call per delta without `index`)."""

    def __init__(self, json_mode: bool) -> None:
        self.json_mode = json_mode
        self.calls: dict[int, int] = {}  # choice index -> calls seen
        self.open: dict[int, int] = {}  # choice index -> index of the call being streamed

    def chunk(self, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
            return data
        for choice in data["choices"]:
            if not isinstance(choice, dict):
                continue
            ci = choice.get("index", 0)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                legacy = delta.pop("function_call", None)
                if legacy and not delta.get("tool_calls"):
                    delta["tool_calls"] = [{"function": legacy}]
                if delta.get("tool_calls"):
                    delta["tool_calls"] = [self._call(ci, c) for c in delta["tool_calls"]]
                    if delta.get("content") == "":
                        delta["content"] = None
            _finish(choice, bool(self.calls.get(ci)))
        return data

    def _call(self, ci: int, call: Any) -> dict[str, Any]:
        call = dict(call) if isinstance(call, dict) else {}
        fn = call.get("function") or {}
        starts = "id" in call or "name" in fn
        if "index" in call:
            index = call["index"]
        elif starts:
            index = self.calls.get(ci, 0)
        else:
            index = self.open.get(ci, 0)
        if starts and index >= self.calls.get(ci, 0):
            self.calls[ci] = index + 1
            call.setdefault("id", _call_id())
            call["type"] = call.get("type") or "function"
            call["function"] = {"name": fn.get("name", ""), "arguments": "", **fn}
        self.open[ci] = index
        out = _tool_call(call, index, stream=True)
        if starts and "arguments" not in out["function"]:
            out["function"]["arguments"] = ""
        return out


# ---- the transport ------------------------------------------------------------------------------------------


def _is_generation(request: httpx.Request) -> bool:
    return request.method == "POST" and request.url.path.endswith(("/chat/completions", "/completions"))


class ProviderTransport(httpx.AsyncBaseTransport):
    """Wraps the real transport: translates generation requests out and their answers back."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not _is_generation(request):
            return await self.inner.handle_async_request(request)
        try:
            body = json.loads(await request.aread() or b"{}")
        except ValueError:
            return await self.inner.handle_async_request(request)
        out = translate_request(body) if isinstance(body, dict) else body
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("content-length",)}
        headers["accept-encoding"] = "identity"  # this layer reads the bytes
        sent = httpx.Request(request.method, request.url, headers=headers, content=json.dumps(out).encode())
        sent.extensions = request.extensions
        resp = await self.inner.handle_async_request(sent)
        if resp.status_code != 200:
            return resp
        json_mode = isinstance(body, dict) and wants_json(out)
        headers = [(k, v) for k, v in resp.headers.raw if k.lower() not in (b"content-length",)]
        if "text/event-stream" in resp.headers.get("content-type", ""):
            stream = _SSEStream(resp, StreamState(json_mode))
            return httpx.Response(200, headers=headers, stream=stream, extensions=resp.extensions)
        raw = b"".join([part async for part in resp.stream])
        await resp.aclose()
        try:
            data = normalize_response(json.loads(raw), json_mode)
            raw = json.dumps(data, ensure_ascii=False).encode()
        except ValueError:
            pass  # not JSON: the relay reports it
        return httpx.Response(200, headers=headers, content=raw, extensions=resp.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _SSEStream(httpx.AsyncByteStream):
    def __init__(self, resp: httpx.Response, state: StreamState) -> None:
        self.resp, self.state = resp, state

    async def __aiter__(self) -> AsyncIterator[bytes]:
        buffer = b""
        async for part in self.resp.stream:
            buffer += part.replace(b"\r\n", b"\n")
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                yield self._event(event) + b"\n\n"
        if buffer.strip():
            yield self._event(buffer) + b"\n\n"

    def _event(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        data = b"\n".join(line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:"))
        if not data or data.strip() == b"[DONE]":
            return event
        try:
            obj = json.loads(data)
        except ValueError:
            return event
        return b"data: " + json.dumps(self.state.chunk(obj), ensure_ascii=False).encode()

    async def aclose(self) -> None:
        await self.resp.aclose()
