"""A small keep-alive HTTP/1.1 client for the loopback engines, on raw asyncio streams.

Why not httpx here: on the hot path to a local engine httpx costs about a millisecond of CPU per request and its
connection pool slows down as concurrency grows (the router's overhead budget is 1 ms). The engines are our
own uvicorn servers on 127.0.0.1 speaking plain HTTP/1.1, so the protocol subset is small: one POST, a
content-length or chunked answer. The cloud keeps httpx (TLS, proxies, odd servers).

Responses look like httpx's where the relay uses them (status_code, headers.get, aread, aiter_lines, aclose)
and failures raise httpx's exception types, so one relay serves both. Closing a response before its end closes
the connection: the engine sees the disconnect and aborts the request.
"""

from __future__ import annotations

import asyncio
import codecs
import sys
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx

IDLE_TTL_S = 4.0  # below uvicorn's default keep-alive (5 s): never reuse a connection the server is closing
MAX_IDLE_PER_HOST = 256
READ_CHUNK = 65536

if sys.version_info >= (3, 11):
    _timeout = asyncio.timeout
else:  # pragma: no cover - Python 3.10
    import contextlib

    @contextlib.asynccontextmanager
    async def _timeout(delay: float):
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        handle = loop.call_later(delay, task.cancel)
        try:
            yield
        except asyncio.CancelledError:
            raise TimeoutError from None
        finally:
            handle.cancel()


class _Conn:
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.idle_since = reader, writer, 0.0

    def close(self) -> None:
        transport = self.writer.transport
        if transport is not None and not transport.is_closing():
            transport.abort()  # no lingering: the engine must notice at once


class LocalResponse:
    def __init__(
        self,
        client: LocalHTTP,
        key: tuple[str, int],
        conn: _Conn,
        status: int,
        headers: dict[str, str],
        read_timeout_s: float,
    ):
        self._client, self._key, self._conn, self._read_timeout_s = client, key, conn, read_timeout_s
        self.status_code, self.headers = status, headers
        self._length = int(headers["content-length"]) if "content-length" in headers else None
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self._keep = headers.get("connection", "").lower() != "close" and (
            self._length is not None or self._chunked
        )
        self._done = False
        self._closed = False

    async def _read(self, coro):
        try:
            async with _timeout(self._read_timeout_s):
                return await coro
        except TimeoutError:
            raise httpx.ReadTimeout("the local engine did not answer in time") from None
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError) as exc:
            raise httpx.RemoteProtocolError(
                f"the local engine connection broke ({type(exc).__name__})"
            ) from None

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        r = self._conn.reader
        if self._chunked:
            while True:
                size_line = await self._read(r.readuntil(b"\r\n"))
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while (await self._read(r.readuntil(b"\r\n"))) != b"\r\n":  # trailers, then the end
                        pass
                    break
                data = await self._read(r.readexactly(size + 2))
                yield data[:-2]
        elif self._length is not None:
            left = self._length
            while left > 0:
                data = await self._read(r.read(min(left, READ_CHUNK)))
                if not data:
                    raise httpx.RemoteProtocolError("the local engine closed the connection mid-body")
                left -= len(data)
                yield data
        else:
            while data := await self._read(r.read(READ_CHUNK)):
                yield data
        self._done = True

    async def aread(self) -> bytes:
        if self._length is not None and not self._done:  # the usual answer: one read, no generator
            data = await self._read(self._conn.reader.readexactly(self._length))
            self._done = True
            return data
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def aiter_lines(self) -> AsyncIterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        buf = ""
        async for data in self.aiter_bytes():
            buf += decoder.decode(data)
            *lines, buf = buf.split("\n")
            for line in lines:
                yield line[:-1] if line.endswith("\r") else line
        buf += decoder.decode(b"", final=True)
        if buf:
            yield buf

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Back to the pool when read to its end, else closed; never waits (so it needs no shield)."""
        if self._closed:
            return
        self._closed = True
        if self._done and self._keep:
            self._client._give_back(self._key, self._conn)
        else:
            self._conn.close()


class LocalHTTP:
    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], read_timeout_s: float | None = None
    ) -> LocalResponse:
        """`read_timeout_s`: this request's limit on each wait for the engine (None: the client's default)."""
        read_timeout_s = read_timeout_s or self.read_timeout_s
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"local engines are reached over plain http, not {parts.scheme!r}"
            )
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {key[0]}:{key[1]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\naccept-encoding: identity\r\n{extra}\r\n"
        )
        request = head.encode("latin-1") + body
        for _ in range(2):
            conn, reused = self._take(key), True
            if conn is None:
                conn, reused = await self._connect(key), False
            try:
                conn.writer.write(request)
                async with _timeout(read_timeout_s):
                    raw = await conn.reader.readuntil(b"\r\n\r\n")
            except asyncio.CancelledError:
                conn.close()  # the client left: closing is how the engine learns to abort the request
                raise
            except TimeoutError:
                conn.close()
                raise httpx.ReadTimeout("the local engine did not answer in time") from None
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError) as exc:
                conn.close()
                if reused:
                    continue  # the server closed this idle connection as we sent: once more on a fresh one
                raise httpx.RemoteProtocolError(
                    f"the local engine dropped the request ({type(exc).__name__})"
                ) from None
            try:
                status, answer_headers = self._parse_head(raw)
            except httpx.HTTPError:
                conn.close()
                raise
            return LocalResponse(self, key, conn, status, answer_headers, read_timeout_s)
        raise httpx.RemoteProtocolError("the local engine dropped the request")

    @staticmethod
    def _parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
        lines = raw.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            raise httpx.RemoteProtocolError("the local engine sent a malformed status line") from None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        return status, headers

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        try:
            async with _timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(*key)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc.strerror or exc}") from None
        return _Conn(reader, writer)

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if (
                now - conn.idle_since < IDLE_TTL_S
                and not conn.reader.at_eof()
                and not conn.writer.is_closing()
            ):
                return conn
            conn.close()
        return None

    def _give_back(self, key: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) >= MAX_IDLE_PER_HOST or conn.reader.at_eof():
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
