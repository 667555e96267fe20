"""One attempt at one backend, up to the commit point, and the stream relay after it.

Commit point: nothing (status, headers, chunks) reaches the client before the first content token. Until then
a failure is an UpstreamFailure the caller retries or reroutes; after it, a failure ends the stream with an
OpenAI-shaped error event and `data: [DONE]`, never a fake `finish_reason: stop`. Closing the relay (the
client went away) closes the upstream stream, so the engine aborts the request and frees its blocks.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from starlette.responses import StreamingResponse

from llmdeploy.openai_api.errors import OpenAIError
from llmdeploy.openai_api.headers import ENGINE_TTFT_HEADER
from llmdeploy.openai_api.sse import DONE
from llmdeploy.policies.route import LOCAL
from llmdeploy.router.localhttp import LocalHTTP, LocalResponse
from llmdeploy.router.normalize import (
    UpstreamFailure,
    body_error,
    connect_failure,
    normalize,
    stream_cut,
    timeout_failure,
)


@dataclass
class Exchange:
    """What the relay learns about one request as it goes (tokens, timings, text for body logging)."""

    alias: str
    client_wants_usage: bool
    keep_text: bool = False
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    content_events: int = 0
    text: list[str] = field(default_factory=list)
    failed_after_commit: str | None = None  # error kind
    stream_complete: bool = False  # the client got the stream's end ([DONE])
    continued: str | None = None  # the backend that finished a stream after the first one failed

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started


@dataclass
class Attempt:
    backend: str  # "local" | "cloud"
    client: httpx.AsyncClient | LocalHTTP
    url: str
    headers: dict[str, str]
    payload: bytes
    secrets: tuple[str, ...] = ()
    read_timeout_s: float | None = None  # local engines: this request's limit (None: the client's default)


def upstream_failure(exc: Exception, backend: str) -> UpstreamFailure:
    if isinstance(exc, UpstreamFailure):
        return exc
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return timeout_failure(backend)
    return connect_failure(backend, exc)


async def _open(a: Attempt):
    """POST and wait for the status line: an httpx.Response (cloud) or a LocalResponse (engines)."""
    try:
        if isinstance(a.client, LocalHTTP):
            resp = await a.client.post(a.url, a.payload, a.headers, a.read_timeout_s)
        else:
            headers = {"content-type": "application/json", **a.headers}
            resp = await a.client.send(
                a.client.build_request("POST", a.url, content=a.payload, headers=headers), stream=True
            )
    except httpx.HTTPError as exc:
        raise upstream_failure(exc, a.backend) from None
    if resp.status_code != 200:
        try:
            body = await resp.aread()
        except httpx.HTTPError:
            body = b""
        finally:
            await close_quietly(resp)
        raise normalize(resp.status_code, body, resp.headers, backend=a.backend, secrets=a.secrets)
    return resp


async def close_quietly(resp) -> None:
    if isinstance(resp, LocalResponse):  # closes without awaiting
        resp.close()
        return
    # shielded: runs while the request is being cancelled (client disconnect), and must still reach the backend
    with anyio.CancelScope(shield=True):
        with contextlib.suppress(Exception):  # closing a broken connection may raise; nothing to do about it
            await resp.aclose()


def _bad_answer(backend: str, what: str) -> UpstreamFailure:
    where = "the cloud endpoint" if backend == "cloud" else "the local engine"
    return UpstreamFailure(
        OpenAIError(502, f"{where} sent {what}.", code="upstream_error"), True, True, kind="bad_answer"
    )


# ---- non-stream -------------------------------------------------------------------------------------------
def engine_first_token_at(headers: Any, started: float) -> float | None:
    """When the first token came, from our engines' TTFT header (the hop to the engine, well under a millisecond
    on loopback, is not counted); None for answers without it (the cloud's)."""
    try:
        return started + float(headers.get(ENGINE_TTFT_HEADER)) / 1000
    except (TypeError, ValueError):
        return None


async def fetch_json(a: Attempt, ex: Exchange) -> dict[str, Any]:
    """The whole answer of a non-stream request, checked for error bodies, with the model set to the alias."""
    resp = await _open(a)
    try:
        raw = await resp.aread()
    except httpx.HTTPError as exc:
        raise upstream_failure(exc, a.backend) from None
    finally:
        await close_quietly(resp)
    try:
        data = json.loads(raw)
    except ValueError:
        raise _bad_answer(a.backend, "a body that is not JSON") from None
    if body_error(data) is not None:  # e.g. Qianfan v1's HTTP 200 {"code": 336501, ...}
        raise normalize(200, data, resp.headers, backend=a.backend, secrets=a.secrets)
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        raise _bad_answer(a.backend, "an answer without choices")
    data["model"] = ex.alias
    if a.backend == LOCAL:  # only our own engines' word is taken for it
        ex.first_token_at = engine_first_token_at(resp.headers, ex.started)
    usage = data.get("usage") or {}
    ex.prompt_tokens, ex.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if ex.keep_text:
        ex.text = [
            str((c.get("message") or {}).get("content") or c.get("text") or "") for c in data["choices"]
        ]
    return data


# ---- stream -----------------------------------------------------------------------------------------------
async def sse_data(resp) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent-event stream (comments and other fields ignored)."""
    lines: list[str] = []
    async for line in resp.aiter_lines():
        if line:
            if line.startswith("data:"):
                lines.append(line[6:] if line.startswith("data: ") else line[5:])
            continue
        if lines:
            yield "\n".join(lines)
            lines = []
    if lines:
        yield "\n".join(lines)


def has_token(obj: dict[str, Any]) -> bool:
    for ch in obj.get("choices") or ():
        if not isinstance(ch, dict):
            continue
        if ch.get("finish_reason") or ch.get("text"):
            return True
        d = ch.get("delta") or {}
        if d.get("content") or d.get("tool_calls") or d.get("function_call") or d.get("reasoning_content"):
            return True
    return False


@dataclass
class OpenStream:
    """A committed stream: the held-back events, and the rest still to read from `events`."""

    resp: Any  # httpx.Response | LocalResponse
    events: AsyncIterator[str]
    held: list[bytes]
    done: bool
    backend: str
    secrets: tuple[str, ...]
    # set by the dispatcher when another backend may finish this stream should it fail after the commit point
    resume: Callable[[], Awaitable[Continuation | None]] | None = None


@dataclass
class Continuation:
    """Another backend's stream that finishes a failed one: its events carry `mark`; `finish(ok)` books it."""

    stream: OpenStream
    ex: Exchange
    mark: dict[str, Any]
    finish: Callable[[bool | None], None]  # True: it completed, False: it failed, None: the client left


def rewrite_event(
    obj: dict[str, Any], raw: str, ex: Exchange, mark: dict[str, Any] | None = None
) -> bytes | None:
    """One chunk as the client gets it: alias as model, usage kept only if asked for; None drops it."""
    changed = False
    if mark:
        obj.update(mark)
        changed = True
    if "usage" in obj:
        usage = obj.get("usage")
        if isinstance(usage, dict):
            ex.prompt_tokens = usage.get("prompt_tokens", ex.prompt_tokens)
            ex.completion_tokens = usage.get("completion_tokens", ex.completion_tokens)
        if not ex.client_wants_usage:
            if not obj.get("choices"):
                return None  # the usage-only chunk we asked for on our own behalf
            del obj["usage"]
            changed = True
    if obj.get("model") != ex.alias:
        obj["model"] = ex.alias
        changed = True
    if has_token(obj):
        ex.content_events += 1
        if ex.keep_text:
            for ch in obj.get("choices") or ():
                ex.text.append(str((ch.get("delta") or {}).get("content") or ch.get("text") or ""))
    return b"data: " + (json.dumps(obj, ensure_ascii=False).encode() if changed else raw.encode()) + b"\n\n"


def _event_json(data: str, backend: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except ValueError:
        raise _bad_answer(backend, "a stream event that is not JSON") from None
    if not isinstance(obj, dict):
        raise _bad_answer(backend, "a stream event that is not an object")
    return obj


async def open_stream(a: Attempt, ex: Exchange) -> OpenStream:
    """Read until the first content token (the commit point); any failure before it raises UpstreamFailure."""
    resp = await _open(a)
    try:
        if "text/event-stream" not in resp.headers.get("content-type", ""):
            raw = await resp.aread()  # e.g. an error body with HTTP 200 instead of a stream
            try:
                data = json.loads(raw)
            except ValueError:
                data = None
            if body_error(data) is not None:
                raise normalize(200, data, resp.headers, backend=a.backend, secrets=a.secrets)
            raise _bad_answer(a.backend, "a non-stream answer to a stream request")
        events = sse_data(resp)
        held: list[bytes] = []
        async for data in events:
            if data.strip() == "[DONE]":
                ex.first_token_at = ex.first_token_at or time.monotonic()
                return OpenStream(resp, events, held, True, a.backend, a.secrets)
            obj = _event_json(data, a.backend)
            if body_error(obj) is not None:
                raise normalize(200, obj, resp.headers, backend=a.backend, secrets=a.secrets)
            out = rewrite_event(obj, data, ex)
            if out is not None:
                held.append(out)
            if has_token(obj):
                ex.first_token_at = time.monotonic()
                return OpenStream(resp, events, held, False, a.backend, a.secrets)
        raise _bad_answer(a.backend, "a stream that ended before its first token")
    except BaseException as exc:
        await close_quietly(resp)
        if isinstance(exc, httpx.HTTPError):
            raise upstream_failure(exc, a.backend) from None
        raise


class RelayEnd:
    """The end of a committed stream, run exactly once: close the upstream, then book the request. Both the
    relay's own `finally` and RelayResponse call it, so a stream the server never started to send (the client
    left at once) is cleaned up too."""

    def __init__(self, stream: OpenStream, on_end: Callable[[], None]) -> None:
        self.stream, self.on_end, self.done = stream, on_end, False

    async def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        await close_quietly(self.stream.resp)
        self.on_end()


class RelayResponse(StreamingResponse):
    def __init__(self, stream: OpenStream, ex: Exchange, end: RelayEnd, headers: dict[str, str]) -> None:
        super().__init__(relay(stream, ex, end), media_type="text/event-stream", headers=headers)
        self.end = end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.end()


@dataclass
class _Outcome:
    done: bool = False  # [DONE] came
    failure: UpstreamFailure | None = None


async def _pump(s: OpenStream, ex: Exchange, out: _Outcome, mark: dict | None = None) -> AsyncIterator[bytes]:
    """The events after the commit point, rewritten for the client, until [DONE] or a failure (in `out`)."""
    try:
        async for data in s.events:
            if data.strip() == "[DONE]":
                out.done = True
                return
            try:
                obj = _event_json(data, s.backend)
                if body_error(obj) is not None:
                    raise normalize(200, obj, s.resp.headers, backend=s.backend, secrets=s.secrets)
            except UpstreamFailure as f:
                out.failure = f
                return
            if mark and not has_token(obj) and "usage" not in obj:
                continue  # a continuation's opening `role: assistant` chunk: the client had one
            b = rewrite_event(obj, data, ex, mark)
            if b is not None:
                yield b
    except httpx.HTTPError as exc:
        out.failure = stream_cut(s.backend, exc)
        return
    out.failure = stream_cut(s.backend)


async def relay(s: OpenStream, ex: Exchange, end: RelayEnd) -> AsyncIterator[bytes]:
    """Everything after the commit point. `ex.stream_complete` is set once the client has been sent the end
    of the stream (`[DONE]`, possibly after an error event); a stream closed before is a client disconnect."""
    try:
        for b in s.held:
            yield b
        out = _Outcome(done=s.done)
        if not out.done:
            async for b in _pump(s, ex, out):
                yield b
        if out.done:
            ex.stream_complete = True
            yield DONE
            return
        failure = out.failure or stream_cut(s.backend)
        ex.failed_after_commit = ex.failed_after_commit or failure.kind
        more = await s.resume() if s.resume is not None else None
        if more is not None:
            async for b in relay_continuation(more, ex):
                yield b
            return
        ex.stream_complete = True
        yield failure.error.sse_event() + DONE
    finally:
        with anyio.CancelScope(shield=True):
            await end()


def _marked(raw: bytes, mark: dict[str, Any]) -> bytes | None:
    obj = json.loads(raw[len(b"data: ") :])
    if not has_token(obj) and "usage" not in obj:
        return None
    return b"data: " + json.dumps({**obj, **mark}, ensure_ascii=False).encode() + b"\n\n"


async def relay_continuation(c: Continuation, ex: Exchange) -> AsyncIterator[bytes]:
    """The rest of a stream from the backend that took over; its own failure ends the stream as usual."""
    out = _Outcome(done=c.stream.done)
    try:
        for raw in c.stream.held:
            if (b := _marked(raw, c.mark)) is not None:
                yield b
        if not out.done:
            async for b in _pump(c.stream, c.ex, out, c.mark):
                yield b
        ex.stream_complete = True
        yield DONE if out.done else (out.failure or stream_cut(c.stream.backend)).error.sse_event() + DONE
    finally:
        ex.content_events += c.ex.content_events
        ex.text += c.ex.text
        ex.completion_tokens = ex.content_events
        with anyio.CancelScope(shield=True):
            await close_quietly(c.stream.resp)
        c.finish(True if out.done else False if out.failure else None)
