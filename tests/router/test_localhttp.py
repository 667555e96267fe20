"""The loopback HTTP/1.1 client against a raw asyncio server: framing, keep-alive reuse, stale connections,
early close (the server must see the disconnect) and httpx-typed errors."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from llmdeploy.router.localhttp import LocalHTTP
from tests.helpers.procs import free_port


class RawServer:
    """Answers each request with the next canned reply; records connections and disconnects."""

    def __init__(self, replies: list[bytes], close_after_each: bool = False):
        self.replies, self.close_after_each = list(replies), close_after_each
        self.connections = 0
        self.disconnects = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(h.split(b":")[1])
                    for h in head.split(b"\r\n")
                    if h.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                writer.write(self.replies.pop(0))
                await writer.drain()
                if self.close_after_each:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.disconnects.set()


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


def chunked(*parts: bytes, end: bool = True) -> bytes:
    out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    out += b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return out + (b"0\r\n\r\n" if end else b"")


async def serve(server: RawServer):
    port = free_port()
    srv = await asyncio.start_server(server.handle, "127.0.0.1", port)
    return srv, f"http://127.0.0.1:{port}/v1/chat/completions"


def test_framing_reuse_and_lines():
    async def main():
        raw = RawServer(
            [
                ok(b'{"a": 1}'),
                chunked(
                    b"data: one\r\n\r\nda", "ta: tw\u00e9".encode()[:-1], "\u00e9".encode()[1:] + b"\n\n"
                ),
            ]
        )
        srv, url = await serve(raw)
        client = LocalHTTP(2, 5)
        r = await client.post(url, b"{}", {"x-request-id": "r1"})
        assert (r.status_code, r.headers["content-type"], await r.aread()) == (
            200,
            "application/json",
            b'{"a": 1}',
        )
        await r.aclose()
        r = await client.post(url, b"{}", {})
        lines = [line async for line in r.aiter_lines()]
        await r.aclose()
        assert lines == ["data: one", "", "data: tw\u00e9", ""]  # a UTF-8 char split across chunks survives
        assert raw.connections == 1  # kept alive and reused
        await client.aclose()
        srv.close()

    asyncio.run(main())


def test_stale_keepalive_connection_is_retried_on_a_fresh_one():
    async def main():
        raw = RawServer([ok(b"1"), ok(b"2")], close_after_each=True)
        srv, url = await serve(raw)
        client = LocalHTTP(2, 5)
        for expected in (b"1", b"2"):
            r = await client.post(url, b"{}", {})
            assert await r.aread() == expected
            await r.aclose()
            await asyncio.sleep(0.05)
        assert raw.connections == 2
        await client.aclose()
        srv.close()

    asyncio.run(main())


def test_closing_early_drops_the_connection_so_the_server_notices():
    async def main():
        raw = RawServer([chunked(b"data: first\n\n", end=False)])
        srv, url = await serve(raw)
        client = LocalHTTP(2, 5)
        r = await client.post(url, b"{}", {})
        lines = r.aiter_lines()
        assert await lines.__anext__() == "data: first"
        await r.aclose()
        await asyncio.wait_for(raw.disconnects.wait(), 5)
        srv.close()

    asyncio.run(main())


def test_errors_are_httpx_types():
    async def main():
        client = LocalHTTP(1, 0.3)
        with pytest.raises(httpx.ConnectError):
            await client.post(f"http://127.0.0.1:{free_port()}/x", b"{}", {})
        raw = RawServer([chunked(b"data: x\n\n", end=False)])
        srv, url = await serve(raw)
        r = await client.post(url, b"{}", {})
        with pytest.raises(httpx.ReadTimeout):
            async for _ in r.aiter_lines():
                pass
        await r.aclose()
        with pytest.raises(httpx.UnsupportedProtocol):
            await client.post("https://127.0.0.1/x", b"{}", {})
        srv.close()

    asyncio.run(main())
