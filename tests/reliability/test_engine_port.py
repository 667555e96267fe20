"""The engine port: a deployment's engine serves only requests carrying its internal token (local processes could
bypass the proxy's key check, rate limit and egress rule), and a body is bounded while it is read (a chunked
body had no bound: it was read whole before its size was checked)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from llmdeploy.openai_api.headers import ENGINE_TOKEN_HEADER
from tests.reliability.conftest import ENGINE_TOKEN, engine_headers, error_of, local_first_spec, token_table
from tests.router.conftest import ALIAS, chat_body, client

WORK = [
    (
        "POST",
        "/v1/chat/completions",
        {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    ),
    ("POST", "/v1/completions", {"model": ALIAS, "prompt": "hi", "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{ALIAS}", None),
]


@pytest.mark.parametrize("method,path,body", WORK)
@pytest.mark.parametrize(
    "token", [None, "", "wrong-token", ENGINE_TOKEN[:-1]], ids=["none", "empty", "wrong", "prefix"]
)
def test_without_the_token_the_engine_answers_401(token_engine, method, path, body, token):
    _, url = token_engine
    headers = {} if token is None else {ENGINE_TOKEN_HEADER: token}
    r = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
    assert (
        r.status_code == 401 and error_of(r)["code"] == "invalid_internal_token" and r.headers["x-request-id"]
    )


@pytest.mark.parametrize("method,path,body", WORK)
def test_with_the_token_the_engine_serves(token_engine, method, path, body):
    _, url = token_engine
    r = httpx.request(method, url + path, json=body, headers=engine_headers(), timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/health", "/load", "/metrics"])
def test_liveness_load_and_metrics_stay_open(token_engine, path):
    """The supervisor and the router's poller read these; they carry no prompt and start no work."""
    r = httpx.get(token_engine[1] + path, timeout=30)
    assert r.status_code == 200 and ENGINE_TOKEN not in r.text


def test_the_router_sends_the_token(start_router, token_engine, access_log):
    _, url = token_engine
    rs = start_router(local_first_spec(), [url], table=token_table([url]))
    with client(rs) as c:
        whole = c.post("/v1/chat/completions", json=chat_body(max_tokens=2))
        stream = c.post("/v1/chat/completions", json=chat_body(max_tokens=2, stream=True))
    assert whole.status_code == 200 and whole.headers["x-llmdeploy-backend"] == "local"
    assert stream.status_code == 200 and stream.headers["x-llmdeploy-backend"] == "local"
    assert not any(ENGINE_TOKEN in line for line in access_log())
    assert ENGINE_TOKEN not in repr(rs.table.revisions)


def test_a_chunked_body_past_the_limit_is_refused_while_it_is_read(token_engine):
    """33 MiB of chunks and no end: the engine answers 413 as soon as the limit (32 MiB) is passed; it used to
    wait for the end of a body of any size, holding all of it in memory."""
    _, url = token_engine
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"{ENGINE_TOKEN_HEADER}: {ENGINE_TOKEN}\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    chunk = json.dumps({"model": ALIAS, "prompt": "x" * (1 << 20)}).encode()[: 1 << 20]
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(30)
        s.sendall(head.encode())
        try:
            for _ in range(33):
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        except OSError:
            pass  # the engine may close as soon as it has answered
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
