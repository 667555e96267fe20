"""ASGI plumbing the router and the engine server share: request ids, capped body reads, client disconnects.

Pure ASGI on purpose: BaseHTTPMiddleware would break streaming disconnects. What it has to get right: every
response carries x-request-id (the client's when it is a sane token, so logs correlate across the hops, else a
new one), even when a bug escapes the app; a body is counted while it is read, so a chunked one cannot grow
without bound; a client that leaves cancels the work it was waiting for.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.requests import ClientDisconnect, Request

from llmdeploy.openai_api import bodies
from llmdeploy.openai_api.errors import payload_too_large
from llmdeploy.openai_api.guard import answer_unexpected

T = TypeVar("T")
REQUEST_ID_HEADER = b"x-request-id"
SANE_ID = re.compile(r"[A-Za-z0-9._:-]+")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


# ---- request id -------------------------------------------------------------------------------------------
def request_id(incoming: str | None, max_length: int) -> str:
    """The client's x-request-id when it is a sane token of at most `max_length` characters, else a new one."""
    if incoming and len(incoming) <= max_length and SANE_ID.fullmatch(incoming):
        return incoming
    return os.urandom(16).hex()  # what uuid4().hex carries, without building a UUID per request


class RequestIdMiddleware:
    """Puts the request id in scope["state"]["request_id"] and on every response, with `default_headers` the
    app did not set itself; a bug that escapes the app becomes a 500 in OpenAI's shape that still carries them,
    logged once. `on_first_request` runs before each request (an embedder may run the app with lifespan off)."""

    def __init__(
        self,
        app: Any,
        *,
        server: str,
        max_id_length: int,
        default_headers: tuple[tuple[bytes, bytes], ...] = (),
        on_first_request: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.app, self.server, self.max_id_length = app, server, max_id_length
        self.default_headers, self.on_first_request = default_headers, on_first_request

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.on_first_request is not None:
            await self.on_first_request()
        given = next((v for k, v in scope["headers"] if k == REQUEST_ID_HEADER), b"").decode("latin-1")
        rid = request_id(given, self.max_id_length)
        scope.setdefault("state", {})["request_id"] = rid
        defaults = ((REQUEST_ID_HEADER, rid.encode()), *self.default_headers)
        started = False

        async def send_with_ids(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", ()))
                present = {k.lower() for k, _ in headers}
                message["headers"] = headers + [(k, v) for k, v in defaults if k not in present]
            await send(message)

        try:
            await self.app(scope, receive, send_with_ids)
        except Exception as exc:  # a bug: still a 500 in OpenAI's shape with the ids, logged once
            await answer_unexpected(send_with_ids, started, exc, f"{self.server} request {rid}")


Handler = Callable[[Request], Awaitable[Any]]


class DirectRoutes:
    """Answers the hot endpoints without the framework's routing and middleware layers, which cost about a fifth
    of the router's CPU per request (bench/RESULTS.md, router overhead profile); everything else goes on to
    `app`. Put it inside RequestIdMiddleware: that layer gives these answers their ids and turns a bug into a 500
    in OpenAI's shape, which is all the skipped layers did for handlers that answer every error themselves."""

    def __init__(self, app: Any, routes: dict[tuple[str, str], Handler]) -> None:
        self.app, self.routes = app, routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        handler = (
            self.routes.get((scope.get("method", ""), scope.get("path", "")))
            if scope["type"] == "http"
            else None
        )
        if handler is None:
            return await self.app(scope, receive, send)
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)


# ---- bodies and disconnects -------------------------------------------------------------------------------
async def read_capped(request: Request, limit: int) -> bytes:
    """The raw body: 415 for another Content-Type, 413 past `limit` (declared or counted while it is read);
    ClientGone when the client leaves mid-body (or the server's read deadline cuts it)."""
    bodies.check_content_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length") or ""
    if declared.isdigit() and int(declared) > limit:
        raise payload_too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise payload_too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


async def until_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client disconnects (call it only once the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts the backend requests it made) if the client disconnects first:
    then ClientGone. The cancelled work is awaited to its end, shielded, so its clean-up has run on return."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()
