"""HTTP/ASGI plumbing under the engine server, kept apart from the OpenAI request handling in server.py.

None of it knows about the engine or OpenAI shapes; it exists so that server.py reads as the request flow only.
What it has to get right: a request id on every response (pure ASGI, since BaseHTTPMiddleware would break
streaming disconnects), a size cap checked before a body is read, disconnects that cancel the work they watch,
and a SIGTERM drain that exits 0 rather than -15.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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

from llmdeploy.openai_api.errors import invalid_json, invalid_request, payload_too_large

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

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


# ---- bodies and disconnects -------------------------------------------------------------------------------


async def read_object(request: Request) -> dict[str, Any]:
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise payload_too_large(MAX_BODY_BYTES)
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise payload_too_large(MAX_BODY_BYTES)
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise invalid_json(str(exc)) from None
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
