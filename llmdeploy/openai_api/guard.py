"""Defences both HTTP servers (the router and the engine) put in front of their apps.

- Slow clients: uvicorn only times out idle keep-alive connections. A client that connects and sends nothing,
  dribbles its headers, or sends its body a byte a second would hold a connection (and a task) forever. The
  guarded protocol gives every request head `read_timeout_s` from its first byte (or from connecting) and every
  body `read_timeout_s` plus the time its bytes so far take at MIN_BODY_BYTES_PER_S; past that the connection
  is closed (a 408 when a half-sent head was waiting).
- Connections over `max_connections` are answered 503 and closed at once, before they cost a request task.
- Unexpected exceptions: `answer_unexpected` turns one into a 500 in OpenAI's shape inside the request-id
  middleware, so the answer still carries the ids, and logs it once (uvicorn would log a second traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # a C parser; uvicorn falls back to h11 without it, and so do we
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

from llmdeploy.openai_api.errors import OpenAIError, server_error

log = logging.getLogger("llmdeploy.http")

PARSER_ENV = "LLMDEPLOY_HTTP_PARSER"  # h11: the pure-Python parser even where httptools is installed (tests)
DEFAULT_READ_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 2048
# a body may take longer in proportion to its size, as long as it comes at this rate or faster
MIN_BODY_BYTES_PER_S = 64 * 1024


@dataclass(frozen=True)
class HTTPLimits:
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS


def _raw_response(status: int, reason: str, err: OpenAIError) -> bytes:
    body = json.dumps(err.body()).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


TOO_MANY = _raw_response(
    503,
    "Service Unavailable",
    OpenAIError(503, "Too many open connections; retry shortly.", code="too_many_connections"),
)
HEAD_TIMEOUT = _raw_response(
    408, "Request Timeout", OpenAIError(408, "The request was not received in time.", code="request_timeout")
)


class _Guard:
    """Read deadlines and the connection cap, shared by the two protocols below (their parsers report a request's
    progress differently). A head has read_timeout_s from connecting or from its first byte. A body has
    read_timeout_s from its head plus its bytes so far at MIN_BODY_BYTES_PER_S: a body that keeps coming at a
    sane rate is never cut, one that trickles is, whatever its declared length (chunked ones have none)."""

    limits: HTTPLimits = HTTPLimits()
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    connections: set

    # the mixin comes first in the protocols' bases: super() below is uvicorn's protocol
    def connection_made(self, transport: asyncio.Transport) -> None:
        self._guard_init()
        super().connection_made(transport)  # type: ignore[misc]
        self._guard_start(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _guard_start(self, transport: asyncio.Transport) -> bool:
        """Once the base protocol has taken the connection: False when it was refused (over the cap)."""
        if len(self.connections) > self.limits.max_connections:
            log.warning(
                "refusing a connection: %d open (limit %d)",
                len(self.connections),
                self.limits.max_connections,
            )
            transport.write(TOO_MANY)
            transport.close()
            return False
        self._arm(self.limits.read_timeout_s)  # connected and silent counts as a head not sent
        return True

    def _guard_init(self) -> None:
        self._deadline: asyncio.TimerHandle | None = None
        self._partial = False  # bytes of a request head arrived and it is not complete yet
        self._body_since, self._body_bytes = 0.0, 0
        self._in_body = False  # a request's head is complete and its body is not

    def _head_done(self) -> None:
        self._partial = False
        self._body_since, self._body_bytes = self.loop.time(), 0

    def _arm_body(self) -> None:
        due = self._body_since + self.limits.read_timeout_s + self._body_bytes / MIN_BODY_BYTES_PER_S
        self._arm(max(0.0, due - self.loop.time()))

    def _arm(self, delay_s: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_waiting(self) -> bool:
        return self._partial

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._head_waiting():
            self.transport.write(HEAD_TIMEOUT)
        # a body cut short reaches the app as a disconnect (the router books it 499)
        self.transport.close()


class GuardedH11Protocol(_Guard, H11Protocol):
    """uvicorn's pure-Python h11 protocol with the guard: the fallback where httptools is not installed."""

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        if self.conn.their_state is h11.IDLE:  # between requests: this is (part of) the next head
            self._partial = True
            if self._deadline is None:
                self._arm(self.limits.read_timeout_s)
        elif before is not None and before.more_body:
            self._body_bytes += len(data)
        super().data_received(data)
        self._track(before)

    def _track(self, before: Any) -> None:
        cycle = self.cycle
        if cycle is None or self.conn.their_state is h11.IDLE:
            return  # still waiting for (the rest of) a head: its deadline stands
        if cycle is not before:  # a new request's head is complete
            self._head_done()
        if cycle.more_body and not cycle.disconnected:
            self._arm_body()
        else:
            self._disarm()

    def _head_waiting(self) -> bool:
        return self._partial and self.conn.their_state is h11.IDLE


if HttpToolsProtocol is not None:

    class GuardedHttpToolsProtocol(_Guard, HttpToolsProtocol):
        """uvicorn's httptools protocol (a C parser: about a quarter less CPU per request on the router than
        h11, bench/RESULTS.md) with the guard, driven by the parser's callbacks."""

        def on_message_begin(self) -> None:  # the first byte of a head
            super().on_message_begin()
            self._partial = True

        # Deadlines are set once per data_received, after the parser's callbacks: a request that arrives whole
        # (the usual case) arms none.
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                return
            if self._in_body:
                self._arm_body()
            elif self._partial and self._deadline is None:
                self._arm(self.limits.read_timeout_s)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._head_done()
            self._disarm()
            # until on_message_complete, which comes at once for a request without a body
            self._in_body = True

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            self._body_bytes += len(body)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_body = False
            self._disarm()  # a body that came in pieces armed a deadline: the request is whole now


def uvicorn_settings(limits: HTTPLimits | None = None) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for a guarded server."""
    base = (
        GuardedH11Protocol
        if HttpToolsProtocol is None or os.environ.get(PARSER_ENV) == "h11"
        else GuardedHttpToolsProtocol
    )
    protocol = type(f"Limited{base.__name__}", (base,), {"limits": limits or HTTPLimits()})
    log.info("HTTP parser: %s", "h11" if base is GuardedH11Protocol else "httptools")
    return {"http": protocol}


async def answer_unexpected(send: Any, started: bool, exc: BaseException, where: str) -> None:
    """A bug reached the top of an app: log it once and answer 500 in OpenAI's shape if nothing was sent yet."""
    log.error("%s: unexpected %s", where, type(exc).__name__, exc_info=exc)
    if started:
        return  # mid-response: nothing more to say; the server closes the connection
    body = json.dumps(server_error().body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 500,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def add_http_limit_args(p: argparse.ArgumentParser) -> None:
    """The slow-client guards' flags, the same on the engine and the router."""
    p.add_argument(
        "--http-read-timeout",
        type=float,
        default=DEFAULT_READ_TIMEOUT_S,
        help="seconds a client has to send a request's headers, and its body (plus its size at 64 KiB/s), "
        f"before the connection is closed (default: {DEFAULT_READ_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help=f"open connections beyond this are refused with 503 (default: {DEFAULT_MAX_CONNECTIONS})",
    )
