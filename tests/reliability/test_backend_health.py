"""A backend's health is judged by its failures, not by the requests it refuses: a seed out of range (was an
engine 500, a proxy 503 `overloaded`, and seven of them opened the local breaker), an engine's 4xx, a long
non-stream generation (was cut after 120 s and reported as `overloaded`)."""

from __future__ import annotations

import httpx
import pytest

from llmdeploy.policies.snapshot import EngineLoad
from llmdeploy.router.backends import local_read_timeout_s
from tests.reliability.conftest import engine_headers, error_of, local_first_spec, token_table
from tests.router.conftest import ALIAS, chat_body, client, make_spec, wait_until

BAD_SEEDS = [2**64, 2**63, -(2**63) - 1]


def local_breaker(rs) -> str:
    (br,) = rs.router.pool.breakers.values()
    return br.state


@pytest.mark.parametrize("seed", BAD_SEEDS)
def test_the_engine_refuses_a_seed_out_of_range_with_400(token_engine, seed):
    _, url = token_engine
    for path, body in (
        ("/v1/completions", {"model": ALIAS, "prompt": "hi", "max_tokens": 1, "seed": seed}),
        (
            "/v1/chat/completions",
            {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "seed": seed},
        ),
    ):
        r = httpx.post(url + path, json=body, headers=engine_headers(), timeout=30)
        assert r.status_code == 400 and error_of(r)["param"] == "seed", r.text
    ok = {"model": ALIAS, "prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1, "temperature": 1.0}
    assert (
        httpx.post(f"{url}/v1/completions", json=ok, headers=engine_headers(), timeout=60).status_code == 200
    )


def test_bad_seeds_through_the_proxy_never_open_the_local_breaker(start_router, token_engine):
    """The probe: seven such requests opened the breaker and pushed all traffic to the cloud."""
    _, url = token_engine
    rs = start_router(local_first_spec(), [url], table=token_table([url]))
    with client(rs) as c:
        for i in range(12):
            r = c.post("/v1/chat/completions", json=chat_body(max_tokens=1, seed=BAD_SEEDS[i % 3]))
            assert r.status_code == 400 and error_of(r)["param"] == "seed"
        ok = c.post("/v1/chat/completions", json=chat_body(max_tokens=2, seed=7))
    assert ok.status_code == 200 and ok.headers["x-llmdeploy-backend"] == "local"
    assert local_breaker(rs) == "closed"


@pytest.mark.parametrize(
    "error",
    [
        {
            "message": "Invalid value for 'seed'.",
            "type": "invalid_request_error",
            "param": "seed",
            "code": None,
        },
        {
            "message": "too long",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        },
    ],
)
def test_engine_4xx_passes_through_and_never_counts_against_it(fakes, start_router, error):
    """An engine's 400 reaches the client as it is (never a 503), its breaker and window stay clean, local
    traffic keeps flowing; with the cloud off a context error has nowhere else to go."""
    _, engine = fakes
    rs = start_router(make_spec(), [engine.base])
    engine.control(fail=[{"status": 400, "body": {"error": error}, "times": 15}])
    with client(rs) as c:
        answers = [c.post("/v1/chat/completions", json=chat_body()) for _ in range(15)]
        after = c.post("/v1/chat/completions", json=chat_body())
    assert {r.status_code for r in answers} == {400}
    assert {error_of(r)["param"] for r in answers} == {error["param"]}
    assert all(r.headers["x-llmdeploy-backend"] == "local" for r in answers)
    assert after.status_code == 200 and after.headers["x-llmdeploy-backend"] == "local"
    assert local_breaker(rs) == "closed" and rs.router.revision_window(1).errors == 0


def test_read_timeout_grows_with_the_output_at_the_measured_rate():
    load = EngineLoad(decode_tokens_per_s=100.0, predicted_queue_wait_ms=2000.0)
    assert local_read_timeout_s(120, None, load) == pytest.approx(120 + 4 * 2.0)
    assert local_read_timeout_s(120, 1000, load) == pytest.approx(120 + 4 * (2.0 + 10.0))
    slow = EngineLoad(decode_tokens_per_s=2.0)
    assert local_read_timeout_s(120, 1000, slow) == pytest.approx(120 + 4 * 500.0)  # never the 120 s cut
    assert local_read_timeout_s(120, 100, None) > 120  # no /load yet: a cautious rate


def test_a_local_timeout_is_a_504_timeout_never_overloaded(fakes, start_router):
    """The engine takes 3 s. A short request (1 token at 100 tok/s) is cut after the 1 s floor and told so;
    a long one (1,000 tokens) is given the time its generation needs and is served."""
    _, engine = fakes
    engine.control(delay_s=3.0, load={**engine.http.get("/load").json(), "decode_tokens_per_s": 100.0})
    rs = start_router(make_spec(routing={"local_timeout_s": 1.0}), [engine.base])
    with client(rs) as c:
        short = c.post("/v1/chat/completions", json=chat_body(max_tokens=1))
        long = c.post("/v1/chat/completions", json=chat_body(max_tokens=1000))
    assert short.status_code == 504 and error_of(short)["code"] == "upstream_timeout", short.text
    assert long.status_code == 200 and long.headers["x-llmdeploy-backend"] == "local"


def test_an_engine_back_up_starts_with_a_closed_breaker(fakes, start_router):
    """Its failures open the breaker; once it is seen down and up again (a restart, maybe on the same port), its
    predecessor's failures no longer hold it half-open, one probe at a time (local-only keys got 503s)."""
    _, engine = fakes
    rs = start_router(make_spec(), [engine.base])
    engine.control(fail=[{"status": 500, "times": 5}])
    with client(rs) as c:
        assert {c.post("/v1/chat/completions", json=chat_body()).status_code for _ in range(5)} == {503}
        assert local_breaker(rs) == "open"
        rs.call(
            rs.router.pool.mark_down, engine.base
        )  # what a failed connect does; the poller sees it up again
        assert wait_until(lambda: not rs.router.pool.breakers, timeout_s=10)
        assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200
