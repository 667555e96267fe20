"""Local first, SLA-aware overflow before queueing, egress control, and no hangs without a cloud."""

from __future__ import annotations

import concurrent.futures as cf
import time

from tests.router.conftest import (
    CLIENT_KEY,
    LOCAL_ONLY_KEY,
    chat_body,
    client,
    cloud_url,
    make_spec,
    wait_until,
)

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


def set_load(rs, engine, **load) -> None:
    engine.control(load={**IDLE, **load})
    # wait for the router's poller to see it
    wait_until(
        lambda: all(
            r.load is not None and all(getattr(r.load, k) == v for k, v in load.items())
            for rev in rs.router.pool.revision_states(time.monotonic())
            for r in rev.replicas
        )
    )


def backend_of(c, **kw) -> str:
    r = c.post("/v1/chat/completions", json=chat_body(**kw))
    assert r.status_code == 200, r.text
    return r.headers["x-llmdeploy-backend"]


def test_idle_engine_serves_locally_and_cloud_gets_nothing(fakes, start_router):
    cloud, engine = fakes
    rs = start_router(make_spec(cloud_url(cloud)), [engine.base])
    with client(rs) as c:
        assert [backend_of(c) for _ in range(5)] == ["local"] * 5
    assert cloud.stats()["requests"] == 0


def test_deep_queue_overflows_to_cloud_with_alias_rewritten(fakes, start_router):
    cloud, engine = fakes
    rs = start_router(
        make_spec(cloud_url(cloud), routing={"overflow": {"max_queue_depth": 4}}), [engine.base]
    )
    set_load(rs, engine, waiting=4, running=64)
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json=chat_body())
    assert r.headers["x-llmdeploy-backend"] == "cloud" and r.json()["model"] == "chat-model-v1"
    sent = cloud.requests()[-1]
    assert sent["model"] == "ernie-4.5-turbo-128k" and sent["auth_ok"]
    assert rs.router.snapshot()["overflow"] == {"queue_depth": 1.0}


def test_predicted_ttft_sends_long_prompt_to_cloud_short_stays_local(fakes, start_router):
    cloud, engine = fakes
    rs = start_router(make_spec(cloud_url(cloud), sla={"ttft_p99_ms": 1000}), [engine.base])
    # 600 ms of queue ahead and 1000 prompt tokens/s: ~400 tokens of prompt fit in the SLA
    set_load(rs, engine, predicted_queue_wait_ms=600.0, prefill_tokens_per_s=1000.0)
    with client(rs) as c:
        assert backend_of(c) == "local"
        assert backend_of(c, messages=[{"role": "user", "content": "word " * 600}]) == "cloud"
        assert backend_of(c) == "local"
    assert "predicted_ttft" in rs.router.snapshot()["overflow"]


def test_few_free_blocks_overflow_by_kv(fakes, start_router):
    cloud, engine = fakes
    rs = start_router(make_spec(cloud_url(cloud)), [engine.base])
    set_load(rs, engine, free_blocks=4, block_size=16)
    with client(rs) as c:
        assert backend_of(c, max_tokens=16) == "local"
        assert backend_of(c, max_tokens=200) == "cloud"
    assert "kv_blocks" in rs.router.snapshot()["overflow"]


def test_burst_rate_above_local_rps_overflows(fakes, start_router):
    cloud, engine = fakes
    rs = start_router(make_spec(cloud_url(cloud), routing={"burst": {"local_rps": 2}}), [engine.base])
    with client(rs) as c:
        backends = [backend_of(c) for _ in range(6)]
    assert backends[:2] == ["local", "local"] and "cloud" in backends[2:]


def test_key_without_egress_never_reaches_cloud(fakes, start_router):
    cloud, engine = fakes
    rs = start_router(
        make_spec(cloud_url(cloud), routing={"overflow": {"max_queue_depth": 0}, "local_wait_s": 0.3}),
        [engine.base],
    )
    set_load(rs, engine, waiting=5, running=64)
    with client(rs, LOCAL_ONLY_KEY) as c:
        t0 = time.monotonic()
        r = c.post("/v1/chat/completions", json=chat_body())
        waited = time.monotonic() - t0
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert "may not use the cloud" in r.json()["error"]["message"]
    assert waited >= 0.3  # it waited locally for room first
    set_load(rs, engine, waiting=0, running=0)
    with client(rs, LOCAL_ONLY_KEY) as c:
        assert backend_of(c) == "local"
    engine.control(fail=[{"status": 500, "times": 5}])  # local fails: still no cloud for this key
    with client(rs, LOCAL_ONLY_KEY) as c:
        r = c.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 503
    assert cloud.stats()["requests"] == 0


def test_no_egress_header_keeps_request_local(fakes, start_router):
    cloud, engine = fakes
    rs = start_router(make_spec(cloud_url(cloud), routing={"local_wait_s": 0.2}), [engine.base])
    set_load(rs, engine, ready=False)
    with client(rs) as c:
        r = c.post("/v1/chat/completions", json=chat_body(), headers={"x-llmdeploy-allow-cloud": "false"})
        assert r.status_code == 503 and "retry-after" in r.headers
        assert backend_of(c) == "cloud"  # the same key without the header may spill
    assert [q["model"] for q in cloud.requests()] == ["ernie-4.5-turbo-128k"]


def test_egress_denied_request_waits_for_engine_to_come_back(fakes, start_router):
    cloud, engine = fakes
    rs = start_router(make_spec(cloud_url(cloud), routing={"local_wait_s": 5}), [engine.base])
    set_load(rs, engine, ready=False)
    with cf.ThreadPoolExecutor(1) as pool, client(rs, LOCAL_ONLY_KEY) as c:
        fut = pool.submit(c.post, "/v1/chat/completions", json=chat_body())
        time.sleep(0.5)
        assert not fut.done()
        engine.control(load=IDLE)
        r = fut.result(120)
    assert r.status_code == 200 and r.headers["x-llmdeploy-backend"] == "local"
    assert cloud.stats()["requests"] == 0


def test_cloud_disabled_excess_load_gets_503_with_retry_after_not_a_hang(fakes, start_router):
    cloud, engine = fakes
    rs = start_router(
        make_spec(None, routing={"overflow": {"max_queue_depth": 2}, "local_wait_s": 0.2}), [engine.base]
    )
    set_load(rs, engine, waiting=10, running=64)
    with client(rs) as c:
        t0 = time.monotonic()
        rs_ = [c.post("/v1/chat/completions", json=chat_body()) for _ in range(3)]
        elapsed = time.monotonic() - t0
    assert all(r.status_code == 503 and r.headers["retry-after"] for r in rs_)
    assert elapsed < 10
    with client(rs) as c:
        assert c.get("/ready").status_code == 200  # the engine is up, only full


def test_saturating_the_engine_spills_excess_to_cloud_with_zero_failures(fakes, start_router):
    cloud, engine = fakes
    engine.control(delay_s=0.5)
    rs = start_router(
        make_spec(cloud_url(cloud), routing={"overflow": {"max_queue_depth": 0}}), [engine.base]
    )
    set_load(rs, engine, max_num_seqs=3)
    with cf.ThreadPoolExecutor(12) as pool, client(rs) as c:
        results = list(pool.map(lambda _: c.post("/v1/chat/completions", json=chat_body()), range(12)))
    assert all(r.status_code == 200 for r in results)
    backends = [r.headers["x-llmdeploy-backend"] for r in results]
    assert 1 <= backends.count("local") <= 3 + 1 and backends.count("cloud") >= 8
    assert engine.stats()["requests"] == backends.count("local")


def test_ready_reflects_backends(fakes, start_router):
    cloud, engine = fakes
    rs = start_router(make_spec(None), [engine.base])
    with client(rs, None) as c:
        assert c.get("/ready").status_code == 200
        set_load(rs, engine, ready=False)
        assert c.get("/ready").status_code == 503


def test_qianfan_preset_v2_paths_bearer_key_and_no_client_secrets_upstream(fakes, start_router):
    cloud, engine = fakes
    spec = make_spec(cloud_url(cloud), cloud={"provider": "qianfan", "base_url": f"{cloud.base}/v2"})
    rs = start_router(spec, [engine.base])
    set_load(rs, engine, ready=False)
    with client(rs) as c:
        r = c.post(
            "/v1/chat/completions", json=chat_body(), headers={"x-session-id": "s1", "cookie": "session=abc"}
        )
        s = c.post("/v1/completions", json={"model": "chat-model-v1", "prompt": "hi", "stream": True})
    assert r.status_code == 200 and s.status_code == 200
    sent = cloud.requests()
    assert [q["path"] for q in sent] == ["/v2/chat/completions", "/v2/completions"]
    assert all(q["auth_ok"] for q in sent)  # Bearer <cloud key>
    for q in sent:  # nothing of the client's own request headers travels to the cloud
        assert (
            CLIENT_KEY not in str(q) and "cookie" not in q["headers"] and "x-session-id" not in q["headers"]
        )
    snap = rs.router.snapshot()
    assert (
        snap["cloud"]["provider"] == "qianfan"
        and snap["requests"]["cloud"] == 2
        and snap["cloud"]["share"] == 1.0
    )
    metrics = rs.router.metrics.render().decode()
    assert 'llmdeploy_router_cloud_tokens_total{direction="out"}' in metrics and CLIENT_KEY not in metrics
