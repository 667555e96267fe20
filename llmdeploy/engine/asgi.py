"""HTTP/ASGI plumbing under the engine server, kept apart from the OpenAI request handling in server.py.

None of it knows about the engine; it exists so that server.py reads as the request flow only. What it has to
get right: a request id on every response, even when a bug escapes, a size cap enforced while a body is read and
disconnects that cancel the work they watch (all three shared with the router: openai_api/asgi.py), the
internal token a deployment's engine requires, and a SIGTERM drain that exits 0 rather than -15.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import signal
import threading
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

import uvicorn
from fastapi import Request
from fastapi.responses import Response

from llmdeploy.openai_api import bodies
from llmdeploy.openai_api.asgi import ClientGone, RequestIdMiddleware, read_capped
from llmdeploy.openai_api.asgi import unless_disconnected as watch_disconnect
from llmdeploy.openai_api.errors import invalid_request, unauthorized_internal
from llmdeploy.openai_api.headers import ENGINE_TOKEN_HEADER

log = logging.getLogger(
    "llmdeploy.engine.server"
)  # one logger name for the whole server, as before the split
T = TypeVar("T")
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_REQUEST_ID_LENGTH = 128  # the router passes its own ids (64 at most) on; a direct client may send longer


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
    app.add_middleware(RequestIdMiddleware, server="engine", max_id_length=MAX_REQUEST_ID_LENGTH)


# ---- bodies and disconnects -------------------------------------------------------------------------------


async def read_object(request: Request, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The JSON object of a request body: 415 for another Content-Type, 413 past `limit` (counted while it is
    read, so a chunked body cannot grow without bound), 400 for anything that does not parse."""
    body = bodies.loads(await read_capped(request, limit))
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.", code="invalid_body")
    return body


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client disconnects first."""
    return await watch_disconnect(request.receive, work)


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
