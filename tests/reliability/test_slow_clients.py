"""Slow-loris on both servers, with raw sockets: connections that send nothing, half a head, a head or a body a
byte at a time are closed within a bound (the probe saw them open past 50 s), connections over the limit are
refused at once, and ordinary requests keep working meanwhile. The servers run as real processes with the
production wiring (`python -m llmdeploy.router`, `python -m llmdeploy.engine`) and a short --http-read-timeout."""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from llmdeploy.openai_api.guard import PARSER_ENV
from tests.helpers.procs import ServerProcess, free_port
from tests.reliability.conftest import GUARD_ARGS, MAX_CONNECTIONS, READ_TIMEOUT_S, engine_headers
from tests.router.conftest import ALIAS, chat_body

BOUND_S = READ_TIMEOUT_S + 8.0  # the limit plus a generous allowance for a loaded machine
GIVE_UP_S = 40.0  # well under the 50 s the probe saw, well over the bound
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"


@dataclass
class Closed:
    after_s: float  # until the server closed (or answered and closed)
    answer: bytes


def hold(port: int, first: bytes, drip: bytes = b"", every_s: float = 0.5) -> Closed:
    """Connect, send `first`, then one byte of `drip` every `every_s` (cycling) until the server closes."""
    start = time.monotonic()
    answer = b""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(every_s)
        if first:
            s.sendall(first)
        i = 0
        while time.monotonic() - start < GIVE_UP_S:
            try:
                data = s.recv(65536)
            except TimeoutError:
                if drip:
                    try:
                        s.sendall(drip[i % len(drip) : i % len(drip) + 1])
                    except OSError:
                        break
                    i += 1
                continue
            except OSError:
                break
            if not data:
                break
            answer += data
    return Closed(time.monotonic() - start, answer)


SCENARIOS = {
    "idle": (b"", b""),
    "half_head": (HEAD, b""),
    "head_a_byte_at_a_time": (
        b"POST /v1/chat/comp",
        b"letions HTTP/1.1\r\nx-pad: aaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    ),
    "body_a_byte_at_a_time": (HEAD + b"content-length: 100000\r\n\r\n{", b'"a"'),
}


def attack_while_serving(port: int, serve) -> dict[str, Closed]:
    """All scenarios at once, with ordinary requests (serve()) going on meanwhile."""
    with cf.ThreadPoolExecutor(len(SCENARIOS) + 1) as pool:
        futures = {name: pool.submit(hold, port, *args) for name, args in SCENARIOS.items()}
        time.sleep(0.5)
        served = [serve() for _ in range(3)]
        results = {name: f.result() for name, f in futures.items()}
    assert all(r.status_code == 200 for r in served), [r.text for r in served]
    return results


def assert_cut_in_time(results: dict[str, Closed]) -> None:
    for name, closed in results.items():
        assert closed.after_s < BOUND_S, f"{name} held the connection {closed.after_s:.1f}s"
    assert results["half_head"].answer.startswith(b"HTTP/1.1 408"), results["half_head"].answer[:80]


def flood_is_refused(port: int, serve) -> None:
    """More connections than the limit: the extra ones get 503 at once; the limit frees up as they close."""
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS + 4)]
    try:
        extra = socks[-1]
        extra.settimeout(5)
        assert extra.recv(4096).startswith(b"HTTP/1.1 503")
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        try:
            if serve().status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not serve again after the flood")


# httptools is what installs bring; h11 is the fallback where it is missing: both protocols carry the guard
@pytest.fixture(scope="module", params=["httptools", "h11"])
def router_proc(request, fake_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"slow-router-{request.param}")
    port = free_port()
    spec = {
        "model": {"served_alias": ALIAS},
        "listen": f"127.0.0.1:{port}",
        "auth": {"api_key_required": False},
    }
    cfg = root / "llmdeploy.yaml"
    cfg.write_text(yaml.safe_dump(spec))
    args = ["-m", "llmdeploy.router", "--config", str(cfg), "--engine", fake_engine.base, *GUARD_ARGS]
    env = {PARSER_ENV: request.param}
    proc = ServerProcess(
        args, f"http://127.0.0.1:{port}/health", Path(root) / "router.log", env, timeout_s=60
    )
    yield proc.start(), port
    proc.stop()


def test_proxy_cuts_slow_clients_and_keeps_serving(router_proc):
    proc, port = router_proc

    def serve() -> httpx.Response:
        return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat_body(), timeout=30)

    assert_cut_in_time(attack_while_serving(port, serve))
    flood_is_refused(port, serve)
    assert "Traceback" not in proc.logs()
    assert f"HTTP parser: {proc.env[PARSER_ENV]}" in proc.logs()


def test_a_body_sent_in_pieces_is_not_cut_while_its_answer_takes_longer_than_the_read_timeout(
    router_proc, fake_engine
):
    """The read deadline covers receiving the request, not answering it: a body that came in two segments armed
    a deadline that (with httptools) stayed armed and closed the connection mid-answer after read_timeout."""
    _, port = router_proc
    fake_engine.reset()
    fake_engine.control(reply="slow but whole", delay_s=READ_TIMEOUT_S + 1.5)
    body = json.dumps(chat_body()).encode()
    head = HEAD + f"content-length: {len(body)}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(READ_TIMEOUT_S + 20)
        s.sendall(head + body[:5])
        time.sleep(0.3)
        s.sendall(body[5:])
        answer = b""
        while b"slow but whole" not in answer:
            data = s.recv(65536)
            if not data:
                break
            answer += data
    fake_engine.control(delay_s=0.0)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert b"slow but whole" in answer


def test_engine_cuts_slow_clients_and_keeps_serving(token_engine):
    proc, url = token_engine
    port = int(url.rsplit(":", 1)[1])
    body = {"model": ALIAS, "prompt": "hi", "max_tokens": 1}

    def serve() -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", json=body, headers=engine_headers(), timeout=60)

    assert_cut_in_time(attack_while_serving(port, serve))
    flood_is_refused(port, serve)
    assert "Traceback" not in proc.logs()
