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
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmdeploy.openai_api.errors import OpenAIError, server_error

log = logging.getLogger("llmdeploy.http")

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


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus read deadlines and a connection cap (limits set by `uvicorn_settings`).

    A head has read_timeout_s from connecting or from its first byte. A body has read_timeout_s from its head
    plus its bytes so far at MIN_BODY_BYTES_PER_S: a body that keeps coming at a sane rate is never cut, one
    that trickles is, whatever its declared length (chunked ones have none)."""

    limits: HTTPLimits = HTTPLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._partial = False  # bytes of a request head arrived and it is not complete yet
        self._body_since, self._body_bytes = 0.0, 0
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.warning(
                "refusing a connection: %d open (limit %d)",
                len(self.connections),
                self.limits.max_connections,
            )
            transport.write(TOO_MANY)
            transport.close()
            return
        self._arm(self.limits.read_timeout_s)  # connected and silent counts as a head not sent

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

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
            self._partial = False
            self._body_since, self._body_bytes = self.loop.time(), 0
        if cycle.more_body and not cycle.disconnected:
            due = self._body_since + self.limits.read_timeout_s + self._body_bytes / MIN_BODY_BYTES_PER_S
            self._arm(max(0.0, due - self.loop.time()))
        else:
            self._disarm()

    def _arm(self, delay_s: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._partial and self.conn.their_state is h11.IDLE:
            self.transport.write(HEAD_TIMEOUT)
        # a body cut short reaches the app as a disconnect (the router books it 499)
        self.transport.close()


def uvicorn_settings(limits: HTTPLimits | None = None) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for a guarded server."""
    protocol = type("GuardedH11", (GuardedH11Protocol,), {"limits": limits or HTTPLimits()})
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
