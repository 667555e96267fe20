"""Bodies no server should choke on, on the proxy and on the engine: deeply nested JSON (was a 500 with a
RecursionError and two tracebacks), Content-Types other than JSON (were parsed as JSON and served), and a bug
anywhere in the request path (was a bare 500 without the ids, missing from the access log and the metrics)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from tests.reliability.conftest import ID_HEADERS, engine_headers, error_of
from tests.router.conftest import ALIAS, chat_body, client, make_spec

DEEP = 5000


def nested(depth: int, where: str = "x") -> bytes:
    """A valid chat body with a `depth`-deep array under an extra field."""
    head = json.dumps(chat_body(max_tokens=2))[:-1].encode()
    return head + f', "{where}": '.encode() + b"[" * depth + b"]" * depth + b"}"


def requests_metric(rs, status: str) -> float:
    return rs.router.metrics.requests.labels("none", "none", status)._value.get()


@pytest.mark.parametrize("depth", [DEEP, 1000, 200])
def test_deep_json_is_a_400_with_ids_booked_and_no_traceback(fakes, start_router, access_log, caplog, depth):
    _, engine = fakes
    rs = start_router(make_spec(), [engine.base])
    caplog.set_level(logging.INFO)
    with client(rs) as c:
        r = c.post("/v1/chat/completions", content=nested(depth), headers={"x-request-id": "deep-1"})
        whole = c.post("/v1/chat/completions", content=b"[" * DEEP + b"]" * DEEP)
    for resp in (r, whole):
        assert resp.status_code == 400 and error_of(resp)["code"] == "invalid_json"
        assert all(h in resp.headers for h in ID_HEADERS)
    assert r.headers["x-request-id"] == "deep-1"
    lines = access_log()
    assert any(
        "rid=deep-1" in line and "status=400" in line and "error=invalid_json" in line for line in lines
    )
    assert requests_metric(rs, "400") == 2
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
    assert engine.stats()["requests"] == 0


def test_deep_json_on_the_engine_is_a_400_with_its_id(token_engine):
    proc, url = token_engine
    body = json.dumps({"model": ALIAS, "prompt": "hi", "max_tokens": 1})[:-1].encode()
    body += b', "x": ' + b"[" * DEEP + b"]" * DEEP + b"}"
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = httpx.post(url + path, content=body, headers=engine_headers(), timeout=30)
        assert r.status_code == 400 and error_of(r)["code"] == "invalid_json", (path, r.text)
        assert r.headers["x-request-id"]
    assert "Traceback" not in proc.logs() and "RecursionError" not in proc.logs()


REFUSED_TYPES = [
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=xyz",
    "application/xml",
]


@pytest.mark.parametrize("content_type", REFUSED_TYPES)
def test_other_content_types_get_415_on_the_proxy(fakes, start_router, content_type):
    _, engine = fakes
    rs = start_router(make_spec(), [engine.base])
    with client(rs) as c:
        r = c.post(
            "/v1/chat/completions", content=json.dumps(chat_body()), headers={"content-type": content_type}
        )
    assert r.status_code == 415 and error_of(r)["code"] == "unsupported_media_type"
    assert all(h in r.headers for h in ID_HEADERS)
    assert engine.stats()["requests"] == 0


@pytest.mark.parametrize("content_type", REFUSED_TYPES)
def test_other_content_types_get_415_on_the_engine(token_engine, content_type):
    _, url = token_engine
    body = json.dumps({"model": ALIAS, "prompt": "hi", "max_tokens": 1})
    r = httpx.post(
        f"{url}/v1/completions", content=body, headers={**engine_headers(), "content-type": content_type}
    )
    assert (
        r.status_code == 415 and error_of(r)["code"] == "unsupported_media_type" and r.headers["x-request-id"]
    )


@pytest.mark.parametrize("content_type", [None, "application/json", "application/json; charset=utf-8"])
def test_json_and_no_content_type_are_served(fakes, start_router, token_engine, content_type):
    _, engine = fakes
    rs = start_router(make_spec(), [engine.base])
    headers = {"content-type": content_type} if content_type else {}
    with client(rs) as c:
        r = c.post("/v1/chat/completions", content=json.dumps(chat_body()), headers=headers)
    assert r.status_code == 200, r.text
    body = json.dumps({"model": ALIAS, "prompt": "hi", "max_tokens": 1})
    e = httpx.post(f"{token_engine[1]}/v1/completions", content=body, headers={**engine_headers(), **headers})
    assert e.status_code == 200, e.text


@pytest.mark.parametrize("where", ["before_routing", "in_dispatch"])
def test_a_bug_in_the_request_path_is_a_booked_500_with_ids(fakes, start_router, access_log, caplog, where):
    """Whatever raises, the client gets OpenAI's shape and the ids; the log has one record of it."""
    _, engine = fakes
    rs = start_router(make_spec(), [engine.base])

    def boom(*_a, **_kw):
        raise RuntimeError("injected bug")

    if where == "before_routing":
        rs.router._facts = boom
    else:
        rs.router.dispatcher._execute = boom
    caplog.set_level(logging.INFO)
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json=chat_body(), headers={"x-request-id": f"bug-{where}"})
    assert r.status_code == 500 and error_of(r)["code"] == "internal_error"
    assert r.headers["x-request-id"] == f"bug-{where}" and all(h in r.headers for h in ID_HEADERS)
    assert any(f"rid=bug-{where}" in line and "status=500" in line for line in access_log())
    assert requests_metric(rs, "500") == 1
    assert len([rec for rec in caplog.records if rec.exc_info]) == 1
    assert rs.router.metrics.inflight._value.get() == 0


def test_out_of_vocabulary_ids_with_echo_are_a_400_not_an_overflow(token_engine):
    """Found by the schema fuzz: echo decoded the ids before their range was checked (an OverflowError, 500)."""
    _, url = token_engine
    for ids in ([2**70], [[5, -(2**40)]], [3, 10**6]):
        body = {"model": ALIAS, "prompt": ids, "max_tokens": 1, "echo": True}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=engine_headers(), timeout=30)
        assert r.status_code == 400 and error_of(r)["param"] == "prompt", r.text


def test_a_vanishing_repetition_penalty_under_a_grammar_is_served(token_engine):
    """Found by the schema fuzzer: repetition_penalty 5e-324 (legal: > 0) made the seen tokens' logits +inf,
    sampling picked a token the grammar forbids, and the request failed with a 500."""
    proc, url = token_engine
    body = {
        "model": ALIAS,
        "prompt": ["S\u00fb\\#5\u009e\U0002212bx", "\u00c4", "\u00be\u00ed"],
        "max_tokens": 4,
        "min_tokens": 1,
        "temperature": 0.5,
        "seed": -3538,
        "logprobs": 2,
        "repetition_penalty": 5e-324,
        "guided_regex": "m\u0095w",
    }
    r = httpx.post(f"{url}/v1/completions", json=body, headers=engine_headers(), timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    assert "Traceback" not in proc.logs()
