"""Failover, retries before the commit point only, error normalisation end to end, circuit breakers."""

from __future__ import annotations

import concurrent.futures as cf
import time

from tests.helpers.procs import free_port
from tests.router.conftest import CLOUD_KEY, chat_body, client, cloud_url, make_spec, sse_events, wait_until

IDLE = {
    "waiting": 0,
    "running": 0,
    "free_blocks": 1000,
    "total_blocks": 1024,
    "block_size": 16,
    "prefill_tokens_per_s": 10000.0,
    "predicted_queue_wait_ms": 0.0,
    "max_num_seqs": 64,
    "ready": True,
}
BUSY = {**IDLE, "waiting": 100, "running": 64}


def cloud_first(fakes, start_router, **spec_over):
    """A router whose engine is saturated, so every request goes to the cloud first."""
    cloud, engine = fakes
    engine.control(load=BUSY)
    return start_router(make_spec(cloud_url(cloud), **spec_over), [engine.base])


def test_engine_down_fails_over_to_cloud(fakes, start_router):
    cloud, engine = fakes
    dead = f"http://127.0.0.1:{free_port()}"
    rs = start_router(make_spec(cloud_url(cloud)), [dead])
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json=chat_body())
        s = c.post("/v1/chat/completions", json=chat_body(stream=True))
    assert r.status_code == 200 and r.headers["x-llmdeploy-backend"] == "cloud"
    assert s.status_code == 200 and sse_events(s)[-1] == "[DONE]"


def test_local_failure_before_first_token_is_invisible(fakes, start_router):
    cloud, engine = fakes
    rs = start_router(make_spec(cloud_url(cloud)), [engine.base])
    engine.control(
        fail=[{"status": 503, "body": {"object": "error", "message": "overloaded", "code": 503}, "times": 2}]
    )
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json=chat_body())
        s = c.post("/v1/chat/completions", json=chat_body(stream=True))
    assert r.status_code == 200 and r.headers["x-llmdeploy-backend"] == "cloud"
    events = sse_events(s)
    assert s.headers["x-llmdeploy-backend"] == "cloud"
    assert (
        "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
        == "Hello from the fake cloud"
    )
    assert rs.router.revision_window(1).errors == 2  # the revision's own failures still count against it


def test_local_stream_cut_before_first_token_is_rerouted(fakes, start_router):
    cloud, engine = fakes
    engine.control(cut_after=0)
    rs = start_router(make_spec(cloud_url(cloud)), [engine.base])
    with client(rs) as c:
        s = c.post("/v1/chat/completions", json=chat_body(stream=True))
    assert s.headers["x-llmdeploy-backend"] == "cloud" and sse_events(s)[-1] == "[DONE]"


def test_context_length_locally_goes_to_the_longer_cloud(fakes, start_router):
    cloud, engine = fakes
    engine.control(
        fail=[
            {
                "status": 400,
                "body": {
                    "error": {
                        "message": "too long",
                        "type": "invalid_request_error",
                        "code": "context_length_exceeded",
                        "param": "messages",
                    }
                },
            }
        ]
    )
    rs = start_router(make_spec(cloud_url(cloud)), [engine.base])
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200 and r.headers["x-llmdeploy-backend"] == "cloud"


def test_cloud_429_is_retried_after_retry_after(fakes, start_router):
    cloud, _ = fakes
    rs = cloud_first(fakes, start_router)
    cloud.control(
        fail=[
            {
                "status": 429,
                "headers": {"Retry-After": "1"},
                "body": {
                    "error": {"code": "rpm_rate_limit_exceeded", "message": "rpm", "type": "rate_limit_error"}
                },
            }
        ]
    )
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200 and r.headers["x-llmdeploy-backend"] == "cloud"
    times = [q["time"] for q in cloud.requests()]
    assert len(times) == 2 and times[1] - times[0] >= 0.9


def test_legacy_200_error_body_is_retried(fakes, start_router):
    cloud, _ = fakes
    rs = cloud_first(fakes, start_router)
    cloud.control(fail=[{"status": 200, "body": {"code": 336501, "msg": "Rate limit reached for RPM"}}])
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert cloud.stats()["requests"] == 2


def test_insufficient_quota_is_not_retried(fakes, start_router):
    cloud, engine = fakes
    rs = cloud_first(fakes, start_router)
    cloud.control(
        fail=[
            {"status": 429, "body": {"error": {"code": "insufficient_quota", "message": "quota"}}, "times": 5}
        ]
    )
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json=chat_body())
    assert cloud.stats()["requests"] == 1
    assert (
        r.status_code == 200 and r.headers["x-llmdeploy-backend"] == "local"
    )  # failed over to the busy engine


def test_5xx_retries_then_a_clean_error_with_retry_after(fakes, start_router):
    cloud, engine = fakes
    engine.control(load=BUSY, fail=[{"status": 500, "times": 10}])
    rs = start_router(make_spec(cloud_url(cloud)), [engine.base])
    cloud.control(fail=[{"status": 502, "body": "<html>bad gateway</html>", "times": 10}])
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json=chat_body())
    assert cloud.stats()["requests"] == 3  # max_retries 2
    assert (
        r.status_code == 503
        and r.headers["retry-after"]
        and set(r.json()["error"]) == {"message", "type", "param", "code"}
    )


def test_retries_happen_only_before_the_first_byte(fakes, start_router):
    cloud, _ = fakes
    rs = cloud_first(fakes, start_router)
    cloud.control(cut_after=2)
    with client(rs) as c:
        s = c.post("/v1/chat/completions", json=chat_body(stream=True))
    events = sse_events(s)
    assert s.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] and not any(
        e.get("choices") and e["choices"][0].get("finish_reason") == "stop"
        for e in events[:-1]
        if isinstance(e, dict)
    )
    assert [e["choices"][0]["delta"].get("content") for e in events[1:3]] == ["Hello", " from"]
    assert cloud.stats()["requests"] == 1  # no retry once the client has seen tokens


def test_error_event_after_commit_is_normalised(fakes, start_router):
    cloud, _ = fakes
    rs = cloud_first(fakes, start_router)
    cloud.control(error_after=1, error_event={"object": "error", "message": "boom", "code": 500})
    with client(rs) as c:
        events = sse_events(c.post("/v1/chat/completions", json=chat_body(stream=True)))
    err = events[-2]["error"]
    assert (
        set(err) == {"message", "type", "param", "code"}
        and "boom" in err["message"]
        and events[-1] == "[DONE]"
    )


def test_stall_before_first_token_times_out_and_fails_over(fakes, start_router):
    cloud, engine = fakes
    engine.control(load=BUSY)
    cloud.control(stall_after=0)
    rs = start_router(make_spec(cloud_url(cloud), cloud={"timeout_s": 0.5, "max_retries": 0}), [engine.base])
    with client(rs) as c:
        s = c.post("/v1/chat/completions", json=chat_body(stream=True))
    assert s.headers["x-llmdeploy-backend"] == "local" and sse_events(s)[-1] == "[DONE]"


def test_cloud_no_permission_gives_502_without_secrets(fakes, start_router, caplog):
    cloud, _ = fakes
    rs = cloud_first(fakes, start_router, routing={"local_wait_s": 0})
    cloud.control(no_permission=True)
    rs.table.swap([])  # no local engine at all
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_config_error"
    assert CLOUD_KEY not in r.text and cloud.stats()["requests"] == 1
    recorded = cloud.requests()[-1]
    assert "authorization" not in recorded["headers"] and CLOUD_KEY not in str(recorded)


def test_cloud_breaker_opens_and_recovers(fakes, start_router):
    cloud, engine = fakes
    rs = cloud_first(
        fakes,
        start_router,
        cloud={"max_retries": 0},
        routing={"breaker": {"consecutive_failures": 3, "cooldown_s": 1.0}, "local_wait_s": 0.1},
    )
    cloud.control(fail=[{"status": 500, "times": 3}])
    with client(rs) as c:
        for _ in range(3):
            assert c.post("/v1/chat/completions", json=chat_body()).headers["x-llmdeploy-backend"] == "local"
        assert rs.router.cloud_breaker.state == "open"
        # local is over its queue limit and the cloud is broken: a quick 503 telling when to come back
        r = c.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and cloud.stats()["requests"] == 3
        time.sleep(1.1)
        r = c.post("/v1/chat/completions", json=chat_body())  # the half-open probe succeeds
        assert r.headers["x-llmdeploy-backend"] == "cloud" and rs.router.cloud_breaker.state == "closed"
        assert "breaker_open" in c.get("/metrics").text


def test_engine_breaker_routes_around_a_failing_replica(fakes, start_router, tmp_path):
    from tests.helpers.fake_cloud import FakeCloud

    cloud, engine = fakes
    other = FakeCloud(tmp_path).start()
    try:
        other.control(reply="second replica")
        # least loaded, not by prefix: every request here has the same prompt, which would pin one replica
        routing = {"breaker": {"consecutive_failures": 2, "cooldown_s": 30}, "replica_choice": "least_loaded"}
        rs = start_router(make_spec(cloud_url(cloud), routing=routing), [engine.base, other.base])
        engine.control(fail=[{"status": 500, "times": 100}])
        with client(rs) as c:
            answers = [c.post("/v1/chat/completions", json=chat_body()) for _ in range(8)]
        assert all(r.status_code == 200 for r in answers)
        assert engine.stats()["requests"] == 2  # then its breaker opened
        assert rs.router.snapshot()["revisions"][0]["replicas"][0]["breaker"] == "open"
    finally:
        other.stop()


def test_engine_killed_under_load_moves_requests_to_cloud_with_zero_failures(fakes, start_router, tmp_path):
    from tests.helpers.fake_cloud import FakeCloud

    cloud, _ = fakes
    victim = FakeCloud(tmp_path).start()
    victim.control(delay_s=0.3)
    rs = start_router(make_spec(cloud_url(cloud)), [victim.base])
    with cf.ThreadPoolExecutor(8) as pool, client(rs) as c:
        futures = [pool.submit(c.post, "/v1/chat/completions", json=chat_body()) for _ in range(8)]
        time.sleep(0.15)
        victim.proc.stop(sig=9)
        futures += [pool.submit(c.post, "/v1/chat/completions", json=chat_body()) for _ in range(8)]
        results = [f.result(180) for f in futures]
    assert [r.status_code for r in results] == [200] * 16
    assert all(r.headers["x-llmdeploy-backend"] == "cloud" for r in results[8:])
    assert wait_until(lambda: not rs.router.snapshot()["revisions"][0]["replicas"][0]["usable"])
