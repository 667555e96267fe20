"""HTTP/ASGI plumbing under the engine server, kept apart from the OpenAI request handling in server.py.

None of it knows about the engine; it exists so that server.py reads as the request flow only. What it has to
get right: a request id on every response, even when a bug escapes (pure ASGI, since BaseHTTPMiddleware would
break streaming disconnects), the internal token a deployment's engine requires, a size cap enforced while a
body is read, disconnects that cancel the work they watch, and a SIGTERM drain that exits 0 rather than -15.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import signal
import threading
import uuid
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

import anyio
import uvicorn
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from llmdeploy.openai_api import bodies
from llmdeploy.openai_api.errors import invalid_request, payload_too_large, unauthorized_internal
from llmdeploy.openai_api.guard import answer_unexpected
from llmdeploy.openai_api.headers import ENGINE_TOKEN_HEADER

log = logging.getLogger(
    "llmdeploy.engine.server"
)  # one logger name for the whole server, as before the split
T = TypeVar("T")
MAX_BODY_BYTES = 32 * 1024 * 1024
CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


# ---- request id -------------------------------------------------------------------------------------------


class RequestIdMiddleware:
    """Pure ASGI (BaseHTTPMiddleware would break streaming disconnects): echo a sane client id or make one."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        rid = given if CLIENT_REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        started = False

        async def send_with_id(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # a bug: a 500 in OpenAI's shape with the id, logged once
            await answer_unexpected(send_with_id, started, exc, f"engine request {rid}")


# ---- the internal token -----------------------------------------------------------------------------------

# the routes that take a prompt or do work; /health, /load and /metrics stay open for the supervisor and poller
GUARDED_PATHS = ("/v1/", "/tokenize", "/detokenize")


class InternalTokenGuard:
    """An engine the daemon started serves only its router: requests that do work must carry the token."""

    def __init__(self, app: Any, token: str):
        self.app, self.token = app, token.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED_PATHS):
            given = dict(scope.get("headers") or []).get(ENGINE_TOKEN_HEADER.encode(), b"")
            if not hmac.compare_digest(given, self.token):
                return await unauthorized_internal().response()(scope, receive, send)
        await self.app(scope, receive, send)


def install_plumbing(app: Any, internal_token: str | None) -> None:
    """The request id outermost (even a 401 carries it), the token check inside it, and client-gone as 499."""

    async def gone(request: Request, _: Exception) -> Response:
        log.info("request %s: client disconnected while sending its body", request.state.request_id)
        return Response(status_code=499)

    app.add_exception_handler(ClientGone, gone)
    if internal_token:
        app.add_middleware(InternalTokenGuard, token=internal_token)
    app.add_middleware(RequestIdMiddleware)


# ---- bodies and disconnects -------------------------------------------------------------------------------


async def read_object(request: Request, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The JSON object of a request body: 415 for another Content-Type, 413 past `limit` (counted while it is
    read, so a chunked body cannot grow without bound), 400 for anything that does not parse."""
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
    body = bodies.loads(b"".join(chunks))
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.", code="invalid_body")
    return body


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(request))
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


# ---- uvicorn ----------------------------------------------------------------------------------------------


class DrainingServer(uvicorn.Server):
    """uvicorn drains on SIGTERM/SIGINT (stop accepting, finish in-flight up to timeout_graceful_shutdown), then
    re-raises the signal, which would make a clean drain exit with -15; a drained server exits 0 instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info("listening on http://%s:%d", self.config.host, self.config.port)
