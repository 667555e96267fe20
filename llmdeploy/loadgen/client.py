"""One request over httpx, timed as a client sees it: first content chunk (TTFT), last byte, tokens, backend.

Errors never raise out of `send`: each becomes a RequestResult with an error kind a report can count:
  http_<status>[:<OpenAI error code or type>]   an error answer (429, 503, 401, ...)
  error_body[:<code>]                           HTTP 200 whose body is an OpenAI error
  stream_error[:<code>]                         an error event inside the stream
  timeout | connection | truncated | protocol   no answer in time, no connection / dropped, a stream that
                                                ended without finishing, an answer that is not OpenAI's shape
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from llmdeploy.loadgen.results import UNKNOWN_BACKEND, RequestResult, TokenSource
from llmdeploy.loadgen.workload import PlannedRequest

BACKEND_HEADER = "x-llmdeploy-backend"


@dataclass(frozen=True)
class Target:
    api_base: str  # e.g. http://127.0.0.1:8000/v1
    model: str
    headers: dict[str, str] = field(default_factory=dict, repr=False)  # holds the API key: never printed
    stream: bool = True
    timeout_s: float = 120.0
    ignore_eos: bool = False

    @property
    def chat_url(self) -> str:
        return f"{self.api_base}/chat/completions"

    def body(self, req: PlannedRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": req.messages, "stream": self.stream}
        if req.max_tokens is not None:
            body["max_tokens"] = req.max_tokens
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM / llmdeploy extension: every request yields max_tokens
        return body


def error_code(payload: Any) -> str | None:
    """The `code` (else `type`) of an OpenAI error body, or of the flat shapes some servers send."""
    if not isinstance(payload, dict):
        return None
    err = payload.get("error", payload)
    if isinstance(err, dict):
        code = err.get("code") or err.get("type")
        return str(code)[:60] if code not in (None, "") else None
    return None


def http_error_kind(status: int, body: bytes) -> str:
    try:
        code = error_code(json.loads(body))
    except ValueError:
        code = None
    return f"http_{status}" + (f":{code}" if code else "")


@dataclass
class _Reading:
    """What the stream said so far."""

    ttft_s: float | None = None
    chunks: int = 0
    usage: dict[str, Any] | None = None
    finished: bool = False
    done: bool = False
    error: str | None = None


def _read_event(data: str, reading: _Reading, now: float) -> None:
    if data == "[DONE]":
        reading.done = True
        return
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError("a stream chunk is not a JSON object")
    if "error" in obj:
        code = error_code(obj)
        reading.error = "stream_error" + (f":{code}" if code else "")
        return
    if isinstance(obj.get("usage"), dict):
        reading.usage = obj["usage"]
    for choice in obj.get("choices") or []:
        delta = choice.get("delta") or {}
        text = delta.get("content") if "delta" in choice else choice.get("text")
        if text:
            reading.chunks += 1
            if reading.ttft_s is None:
                reading.ttft_s = now
        if choice.get("finish_reason"):
            reading.finished = True
            if reading.ttft_s is None:  # an empty answer: its finish is the first thing the client sees
                reading.ttft_s = now


def _tokens(
    usage: dict[str, Any] | None, fallback: int, fallback_source: TokenSource
) -> tuple[int, TokenSource]:
    if usage and isinstance(usage.get("completion_tokens"), int):
        return usage["completion_tokens"], "usage"
    return fallback, fallback_source


def _prompt_tokens(usage: dict[str, Any] | None) -> int | None:
    n = (usage or {}).get("prompt_tokens")
    return n if isinstance(n, int) else None


async def send(
    client: httpx.AsyncClient,
    target: Target,
    req: PlannedRequest,
    arrival_s: float,
    clock: Callable[[], float],
) -> RequestResult:
    """`arrival_s` and `clock()` are on the same scale (seconds from the level's start)."""
    base = {"arrival_s": arrival_s, "kind": req.kind}
    try:
        return await asyncio.wait_for(_send(client, target, req, base, clock), target.timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        return RequestResult(**base, end_s=clock(), ok=False, backend="none", error="timeout")
    except httpx.RemoteProtocolError:
        return RequestResult(**base, end_s=clock(), ok=False, backend="none", error="connection")
    except (httpx.TransportError, OSError):
        return RequestResult(**base, end_s=clock(), ok=False, backend="none", error="connection")


async def _send(client, target: Target, req: PlannedRequest, base: dict, clock) -> RequestResult:
    async with client.stream("POST", target.chat_url, json=target.body(req), headers=target.headers) as r:
        backend = r.headers.get(BACKEND_HEADER, UNKNOWN_BACKEND)
        common = {**base, "backend": backend, "status": r.status_code}
        if r.status_code >= 400:
            kind = http_error_kind(r.status_code, await r.aread())
            return RequestResult(**common, end_s=clock(), ok=False, error=kind)
        if not target.stream:
            return _whole_answer(common, await r.aread(), clock())
        reading = _Reading()
        try:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    _read_event(line[5:].strip(), reading, clock())
                if reading.done or reading.error:
                    break
        except (ValueError, AttributeError, TypeError):
            return RequestResult(**common, end_s=clock(), ok=False, error="protocol")
        end = clock()
        error = reading.error or (None if reading.done or reading.finished else "truncated")
        tokens, source = _tokens(reading.usage, reading.chunks, "chunks")
        ttft = None if reading.ttft_s is None else reading.ttft_s - base["arrival_s"]
        return RequestResult(
            **common,
            end_s=end,
            ok=error is None,
            error=error,
            ttft_s=ttft,
            output_tokens=tokens,
            prompt_tokens=_prompt_tokens(reading.usage),
            token_source=source,
        )


def _whole_answer(common: dict, raw: bytes, end: float) -> RequestResult:
    try:
        obj = json.loads(raw)
        if "error" in obj:
            code = error_code(obj)
            return RequestResult(
                **common, end_s=end, ok=False, error="error_body" + (f":{code}" if code else "")
            )
        choices = obj["choices"]
        text = "".join((c.get("message") or {}).get("content") or c.get("text") or "" for c in choices)
    except (ValueError, KeyError, TypeError, AttributeError):
        return RequestResult(**common, end_s=end, ok=False, error="protocol")
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else None
    tokens, source = _tokens(usage, len(text.split()), "words")
    return RequestResult(
        **common,
        end_s=end,
        ok=True,
        output_tokens=tokens,
        prompt_tokens=_prompt_tokens(usage),
        token_source=source,
    )


def monotonic_since(start: float) -> Callable[[], float]:
    return lambda: time.perf_counter() - start
