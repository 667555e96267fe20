"""A non-stream client that goes away aborts its engine request, as a stream's does (the probe saw the engine
generate for 100 s for nobody, and the access log said 200)."""

from __future__ import annotations

import json
import socket

import pytest

from tests.reliability.conftest import aborted_total, load_of, local_first_spec, token_table
from tests.router.conftest import CLIENT_KEY, chat_body, wait_until

# logprobs and penalties: every token an ordinary step through the Python sampler (no decode burst, no screened native
# step), so the tiny model's 1,000 tokens outlast the client's disconnect (~0.7 s; in bursts they took 0.18 s, and
# once finished before the router saw the client go)
LONG = chat_body(
    max_tokens=1000,
    ignore_eos=True,
    temperature=0,
    logprobs=True,
    top_logprobs=2,
    presence_penalty=0.5,
    frequency_penalty=0.5,
)


def raw_request(url: str, path: str, body: dict, rid: str) -> socket.socket:
    """Send a request on a raw socket and return it unread: closing it is the client walking away."""
    payload = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {CLIENT_KEY}\r\nx-request-id: {rid}\r\ncontent-length: {len(payload)}\r\n\r\n"
    )
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head.encode() + payload)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_the_engine_request(start_router, token_engine, access_log, stream):
    _, url = token_engine
    assert wait_until(lambda: load_of(url)["running"] == 0, timeout_s=60)
    rs = start_router(local_first_spec(), [url], table=token_table([url]))
    before = aborted_total(url)
    rid = f"gone-{'stream' if stream else 'whole'}"
    sock = raw_request(rs.url, "/v1/chat/completions", {**LONG, "stream": stream}, rid)
    try:
        assert wait_until(lambda: load_of(url)["running"] == 1, timeout_s=60), "never started generating"
    finally:
        sock.close()
    # the router closed its engine connection at once: the engine dropped the request and freed its blocks
    assert wait_until(lambda: aborted_total(url) == before + 1, timeout_s=20)
    load = load_of(url)
    assert load["running"] == 0 and load["waiting"] == 0 and load["free_blocks"] == load["total_blocks"]
    assert wait_until(lambda: any(f"rid={rid}" in line and "status=499" in line for line in access_log()))
    assert rs.router.pool.inflight.get(url, 0) == 0
    (breaker,) = rs.router.pool.breakers.values()
    assert breaker.state == "closed"
