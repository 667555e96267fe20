"""Auth, the order of checks (auth -> alias -> body -> rate limit), bad inputs and response headers."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmdeploy.router.auth import KeyStore
from llmdeploy.spec.models import AuthSpec
from tests.router.conftest import ALIAS, CLIENT_KEY, LOCAL_ONLY_KEY, chat_body, client, cloud_url, make_spec

ID_HEADERS = ("x-request-id", "x-llmdeploy-backend", "x-llmdeploy-revision")


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---- key store (no server) --------------------------------------------------------------------------------


def test_keystore_env_hash_and_generated_keys():
    auth = AuthSpec.model_validate(
        {
            "keys": [
                {"name": "a", "key_env": "K_A", "rpm": 5},
                {"name": "b", "key": "sha256:" + hashlib.sha256(b"bee").hexdigest(), "allow_cloud": False},
                {"name": "unset", "key_env": "K_UNSET"},
            ]
        }
    )
    ks = KeyStore(auth, {"gen": hashlib.sha256(b"generated").hexdigest()}, environ={"K_A": "alpha"})
    assert ks.authenticate({"authorization": "Bearer alpha"}).name == "a"
    assert ks.authenticate({"api-key": "bee"}).allow_cloud is False
    assert ks.authenticate({"authorization": "bearer generated"}).name == "gen"
    for bad in (
        {},
        {"authorization": "Bearer nope"},
        {"authorization": "Basic alpha"},
        {"authorization": "Bearer "},
    ):
        with pytest.raises(Exception) as exc:
            ks.authenticate(bad)
        assert exc.value.status == 401 and exc.value.code == "invalid_api_key"
    assert "alpha" not in repr(ks.entries)  # only digests are kept
    assert ks.rpm_limits() == {"a": 5, "b": None, "gen": None}


def test_no_key_required_means_anonymous():
    ks = KeyStore(AuthSpec(api_key_required=False), environ={})
    assert ks.authenticate({}).name == "anonymous"
    assert ks.authenticate({"authorization": "Bearer whatever"}).name == "anonymous"


# ---- over HTTP --------------------------------------------------------------------------------------------


@pytest.fixture
def rs(fakes, start_router):
    cloud, engine = fakes
    return start_router(
        make_spec(
            cloud_url(cloud),
            auth={
                "keys": [
                    {"name": "app", "key_env": "APP_KEY", "rpm": 3},
                    {"name": "private", "key_env": "LOCAL_KEY", "allow_cloud": False},
                ]
            },
        ),
        [engine.base],
    )


def test_missing_or_wrong_key_is_401_in_openai_shape(rs):
    for key in (None, "sk-wrong"):
        with client(rs, key) as c:
            r = c.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
        assert all(h in r.headers for h in ID_HEADERS)


def test_api_key_header_and_bearer_both_work(rs):
    with httpx.Client(base_url=rs.url, headers={"api-key": CLIENT_KEY}) as c:
        r = c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200 and r.headers["x-llmdeploy-backend"] == "local"


def test_health_is_open_metrics_and_models_are_not(rs):
    with client(rs, None) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/ready").status_code == 200
        assert c.get("/metrics").status_code == 401
        assert c.get("/v1/models").status_code == 401
    with client(rs) as c:
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [ALIAS]
        assert c.get("/metrics").status_code == 200


def test_metrics_public_opens_metrics_only(fakes, start_router):
    cloud, engine = fakes
    rs = start_router(make_spec(cloud_url(cloud), auth={"metrics_public": True}), [engine.base])
    with client(rs, None) as c:
        assert c.get("/metrics").status_code == 200
        assert c.post("/v1/chat/completions", json=chat_body()).status_code == 401


def test_auth_comes_before_alias_and_alias_before_body(rs):
    with client(rs, None) as c:
        assert c.post("/v1/chat/completions", json={"model": "other"}).status_code == 401
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json={"model": "gpt-4", "messages": "not a list"})
        assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
        r = c.post("/v1/chat/completions", json={"model": ALIAS, "messages": "not a list"})
        assert r.status_code == 400 and error_of(r)["param"] == "messages"


def test_bad_bodies_get_400_with_param(rs):
    with client(rs) as c:
        r = c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"
        r = c.post("/v1/chat/completions", content=b"[1, 2]")
        assert r.status_code == 400
        r = c.post(
            "/v1/chat/completions", content=json.dumps(chat_body(temperature=1)).replace("1", "NaN").encode()
        )
        assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"
        r = c.post("/v1/chat/completions", content=b"\xff\xfe{}")
        assert r.status_code == 400
        r = c.post("/v1/chat/completions", json=chat_body(temperature="hot"))
        assert r.status_code == 400 and error_of(r)["param"] == "temperature"
        r = c.post(
            "/v1/chat/completions", json={"model": ALIAS, "messages": [{"role": "wizard", "content": "x"}]}
        )
        assert r.status_code == 400 and error_of(r)["param"].startswith("messages[0]")
        r = c.post("/v1/completions", json={"model": ALIAS})
        assert r.status_code == 400 and error_of(r)["param"] == "prompt"


def test_unknown_fields_are_tolerated(rs, fakes):
    cloud, engine = fakes
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json=chat_body(some_new_openai_field={"x": 1}))
    assert r.status_code == 200
    assert engine.requests()[-1]["body"]["some_new_openai_field"] == {"x": 1}


def test_body_over_limit_is_413(fakes, start_router):
    cloud, engine = fakes
    rs = start_router(make_spec(cloud_url(cloud), routing={"max_body_bytes": 2048}), [engine.base])
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json=chat_body("x" * 5000))
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"

        def chunked():
            yield json.dumps(chat_body("y" * 5000)).encode()

        r = c.post("/v1/chat/completions", content=chunked())  # no content-length: counted while reading
        assert r.status_code == 413


def test_rpm_limit_gives_429_with_retry_after(rs):
    with client(rs) as c:
        codes = [c.post("/v1/chat/completions", json=chat_body()).status_code for _ in range(3)]
        r = c.post("/v1/chat/completions", json=chat_body())
    assert codes == [200, 200, 200]
    assert (
        r.status_code == 429
        and int(r.headers["retry-after"]) >= 1
        and error_of(r)["type"] == "rate_limit_error"
    )
    with client(rs, LOCAL_ONLY_KEY) as c:  # limits are per key
        assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_pinned_revision_header_errors(rs):
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json=chat_body(), headers={"x-llmdeploy-revision": "seven"})
        assert r.status_code == 400 and error_of(r)["param"] == "x-llmdeploy-revision"
        r = c.post("/v1/chat/completions", json=chat_body(), headers={"x-llmdeploy-revision": "7"})
        assert r.status_code == 404 and error_of(r)["code"] == "revision_not_found"
        r = c.post("/v1/chat/completions", json=chat_body(), headers={"x-llmdeploy-revision": "1"})
        assert r.status_code == 200 and r.headers["x-llmdeploy-revision"] == "1"


def test_every_response_carries_ids_and_request_id_is_echoed(rs):
    with client(rs) as c:
        for r in (
            c.get("/nope"),
            c.get("/health"),
            c.post("/v1/chat/completions", json={"model": "x"}),
            c.post("/v1/chat/completions", json=chat_body(), headers={"x-request-id": "abc-123"}),
        ):
            assert all(h in r.headers for h in ID_HEADERS), r.headers
        assert r.headers["x-request-id"] == "abc-123"
        r = c.post("/v1/chat/completions", json=chat_body(), headers={"x-request-id": "bad id\twith junk"})
        assert r.headers["x-request-id"] != "bad id\twith junk" and len(r.headers["x-request-id"]) == 32


JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
FIELDS = [
    "messages",
    "prompt",
    "max_tokens",
    "temperature",
    "n",
    "stop",
    "stream",
    "stream_options",
    "top_p",
    "logprobs",
    "top_logprobs",
    "seed",
    "max_completion_tokens",
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.dictionaries(st.sampled_from(FIELDS), JSONISH, max_size=4),
    st.sampled_from(["chat/completions", "completions"]),
)
def test_fuzzed_bodies_never_get_a_5xx(rs, body, endpoint):
    with client(rs) as c:
        r = c.post(f"/v1/{endpoint}", json={"model": ALIAS, **body})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        error_of(r)
