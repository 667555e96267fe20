"""The router in front of a real `python -m llmdeploy.engine` process on a tiny random Llama, with the fake cloud
beside it: the openai SDK unchanged, disconnects that free engine blocks, kill-failover, queue overflow."""

from __future__ import annotations

import concurrent.futures as cf
import re
from pathlib import Path

import httpx
import openai
import pytest

from llmdeploy.openai_api.headers import ENGINE_TTFT_HEADER
from tests.helpers.procs import ServerProcess, free_port
from tests.router.conftest import ALIAS, CLIENT_KEY, cloud_url, make_spec, wait_until

ENGINE_ARGS = [
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "2",
    "--max-num-batched-tokens",
    "256",
    "--kv-cache-gb",
    "0.02",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--seed",
    "0",
]
CHAT = [{"role": "user", "content": "Hello world! How are you today?"}]


def start_engine(model: Path, log: Path) -> tuple[ServerProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        "-m",
        "llmdeploy.engine",
        "--model",
        str(model),
        "--served-alias",
        ALIAS,
        "--port",
        str(port),
        *ENGINE_ARGS,
    ]
    return ServerProcess(args, f"{url}/health", log, timeout_s=180).start(), url


@pytest.fixture(scope="module")
def real_engine(tiny_llama, tmp_path_factory):
    proc, url = start_engine(tiny_llama, tmp_path_factory.mktemp("engine") / "engine.log")
    yield url
    proc.stop()


def sdk(rs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{rs.url}/v1", api_key=CLIENT_KEY, max_retries=0, timeout=120)


def test_openai_sdk_against_router_and_real_engine(fakes, start_router, real_engine):
    cloud, _ = fakes
    rs = start_router(make_spec(cloud_url(cloud)), [real_engine])
    api = sdk(rs)
    raw = api.chat.completions.with_raw_response.create(
        model=ALIAS, messages=CHAT, max_tokens=8, temperature=0
    )
    out = raw.parse()
    assert (
        raw.headers["x-llmdeploy-backend"] == "local"
        and out.model == ALIAS
        and out.usage.completion_tokens >= 1
    )
    chunks = list(
        api.chat.completions.create(
            model=ALIAS,
            messages=CHAT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content  # greedy: the same answer streamed
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    comp = api.completions.create(model=ALIAS, prompt="The quick brown", max_tokens=5, temperature=0)
    assert comp.choices[0].text and comp.model == ALIAS
    assert cloud.stats()["requests"] == 0


def test_non_stream_ttft_reaches_the_window_from_the_engine(fakes, start_router, real_engine):
    """A non-stream client never sees the first token, yet the canary's TTFT window needs it: the engine says."""
    cloud, _ = fakes
    body = {"model": ALIAS, "messages": CHAT, "max_tokens": 4, "temperature": 0}
    direct = httpx.post(f"{real_engine}/v1/chat/completions", json=body, timeout=60)
    assert direct.status_code == 200 and float(direct.headers[ENGINE_TTFT_HEADER]) > 0
    rs = start_router(make_spec(cloud_url(cloud)), [real_engine])
    r = httpx.post(
        f"{rs.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {CLIENT_KEY}"},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["x-llmdeploy-backend"] == "local"
    w = rs.router.revision_window(1)
    assert w.requests == 1 and w.ttft_p99_ms is not None and 0 < w.ttft_p99_ms < 60_000


def abort_count(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(
        float(v)
        for v in re.findall(r'request_success_total\{[^}]*finished_reason="abort"[^}]*\} ([0-9.e+]+)', text)
    )


def test_client_disconnect_frees_engine_blocks(fakes, start_router, real_engine):
    cloud, _ = fakes
    rs = start_router(make_spec(cloud_url(cloud)), [real_engine])
    before = abort_count(real_engine)
    body = {"model": ALIAS, "messages": CHAT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=rs.url, headers={"authorization": f"Bearer {CLIENT_KEY}"}, timeout=60) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as s,
    ):
        lines = s.iter_lines()
        for _ in range(10):
            next(lines)
        assert httpx.get(f"{real_engine}/load").json()["running"] == 1
    # the router closed its upstream stream: the engine aborted the request and gave its blocks back
    assert wait_until(lambda: abort_count(real_engine) > before, timeout_s=20)
    load = httpx.get(f"{real_engine}/load").json()
    assert load["running"] == 0 and load["waiting"] == 0 and load["free_blocks"] == load["total_blocks"]


def test_deep_queue_overflows_real_engine_to_cloud_with_zero_failures(fakes, start_router, real_engine):
    cloud, _ = fakes
    rs = start_router(
        make_spec(cloud_url(cloud), routing={"overflow": {"max_queue_depth": 0}}), [real_engine]
    )
    api = sdk(rs)

    def one(_):
        r = api.chat.completions.with_raw_response.create(
            model=ALIAS, messages=CHAT, max_tokens=900, extra_body={"ignore_eos": True}
        )
        return r.headers["x-llmdeploy-backend"], r.parse()

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    backends = [b for b, _ in results]
    assert all(out.choices[0].message.content is not None for _, out in results)
    assert 1 <= backends.count("local") <= 2 + 1 and backends.count("cloud") >= 5
    assert "queue_depth" in rs.router.snapshot()["overflow"]


@pytest.mark.full  # CI's time budget; tests/reliability/test_load.py kills an engine under load too
def test_engine_killed_under_load_fails_over_with_zero_failures(fakes, start_router, tiny_llama, tmp_path):
    cloud, _ = fakes
    proc, url = start_engine(tiny_llama, tmp_path / "victim.log")
    try:
        rs = start_router(make_spec(cloud_url(cloud)), [url])
        api = sdk(rs)

        def one(_):
            r = api.chat.completions.with_raw_response.create(
                model=ALIAS, messages=CHAT, max_tokens=400, extra_body={"ignore_eos": True}
            )
            return r.headers["x-llmdeploy-backend"], r.parse()

        with cf.ThreadPoolExecutor(6) as pool:
            first = [pool.submit(one, i) for i in range(6)]
            assert wait_until(lambda: httpx.get(f"{url}/load").json()["running"] >= 1, timeout_s=20)
            proc.stop(sig=9)
            later = [pool.submit(one, i) for i in range(6)]
            results = [f.result(120) for f in first + later]
        assert all(out.choices for _, out in results)  # nobody saw an error
        assert all(b == "cloud" for b, _ in results[6:])
        assert cloud.stats()["requests"] >= 6
        assert not rs.router.snapshot()["revisions"][0]["replicas"][0]["usable"]
    finally:
        proc.stop()
