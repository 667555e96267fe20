"""Reliability rig: what a probe of a running deployment found, kept found.

Fast tests (the default run) use the router in a uvicorn thread (tests/router/conftest.py's RouterServer) in
front of the fake engine or a real tiny engine process, and the fake cloud. The heavy ones (@pytest.mark.slow)
run against a whole deployment made by `llmdeploy apply` (tests/reliability/deployment.py); set
LLMDEPLOY_RELIABILITY_FULL=1 for their full sizes.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmdeploy.openai_api.headers import ENGINE_TOKEN_ENV, ENGINE_TOKEN_HEADER
from llmdeploy.router.table import EngineEndpoint, RevisionRoute, RoutingTable
from tests.helpers.fake_cloud import FakeCloud
from tests.helpers.procs import ServerProcess, free_port
from tests.router.conftest import ALIAS, CLOUD_KEY, RouterServer, deep_merge, make_spec

FULL = os.environ.get("LLMDEPLOY_RELIABILITY_FULL") == "1"
ENGINE_TOKEN = "engine-token-" + secrets.token_hex(8)
ENGINE_ARGS = [
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "4",
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
ID_HEADERS = ("x-request-id", "x-llmdeploy-backend", "x-llmdeploy-revision")
READ_TIMEOUT_S = 2.0  # the test servers' --http-read-timeout: slow clients are cut after this
MAX_CONNECTIONS = 48  # the test servers' --max-connections
GUARD_ARGS = ["--http-read-timeout", str(READ_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS)]


# a tiny engine on a busy CPU is slow: keep its traffic local whatever the SLA predictions say
LOCAL_FIRST = {
    "sla": {"ttft_p99_ms": 600_000, "tpot_p99_ms": 600_000},
    "routing": {"overflow": {"use_predicted_ttft": False}, "local_wait_s": 300},  # nor shed on waits
}


def local_first_spec(cloud: str | None = None, **over: Any):
    return make_spec(cloud, **deep_merge(LOCAL_FIRST, over))


def start_engine(
    model: Path, log: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[ServerProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["-m", "llmdeploy.engine", "--model", str(model), "--served-alias", ALIAS, "--port", str(port)]
    return ServerProcess(
        [*args, *ENGINE_ARGS, *extra], f"{url}/health", log, env=env, timeout_s=180
    ).start(), url


def token_table(urls: list[str], token: str | None = ENGINE_TOKEN) -> RoutingTable:
    engines = [EngineEndpoint(u, f"r{i + 1}", True, token) for i, u in enumerate(urls)]
    return RoutingTable([RevisionRoute(1, "stable", 100.0, engines)])


def error_of(r: Any) -> dict:
    """The OpenAI error object of an answer, checked for its exact shape."""
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def engine_headers() -> dict[str, str]:
    return {ENGINE_TOKEN_HEADER: ENGINE_TOKEN}


def load_of(url: str) -> dict:
    return httpx.get(f"{url}/load", timeout=10).json()


def aborted_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.findall(r'request_success_total\{[^}]*finished_reason="abort"[^}]*\} ([0-9.e+]+)', text)
    return sum(float(v) for v in found)


@pytest.fixture(scope="session")
def cloud(tmp_path_factory):
    fc = FakeCloud(tmp_path_factory.mktemp("cloud"), expected_key=CLOUD_KEY).start()
    yield fc
    fc.stop()


@pytest.fixture(scope="session")
def fake_engine(tmp_path_factory):
    fe = FakeCloud(tmp_path_factory.mktemp("fake-engine")).start()
    yield fe
    fe.stop()


@pytest.fixture
def fakes(cloud, fake_engine):
    cloud.reset()
    fake_engine.reset()
    fake_engine.control(reply="Hello from the local engine")
    return cloud, fake_engine


@pytest.fixture(scope="session")
def token_engine(tiny_llama, tmp_path_factory, stop_at_end):
    """A real engine on the tiny Llama that requires the internal token, as the daemon starts them."""
    log = tmp_path_factory.mktemp("token-engine") / "engine.log"
    proc, url = start_engine(tiny_llama, log, *GUARD_ARGS, env={ENGINE_TOKEN_ENV: ENGINE_TOKEN})
    stop_at_end(proc.stop)
    return proc, url


@pytest.fixture
def start_router():
    started: list[RouterServer] = []

    def start(spec, engines: list[str], **kw: Any) -> RouterServer:
        rs = RouterServer(spec, engines, **kw).start()
        started.append(rs)
        return rs

    yield start
    for rs in started:
        rs.stop()


@pytest.fixture
def access_log(caplog):
    """The router's access-log lines of this test (the router runs in-process)."""
    caplog.set_level(logging.INFO, logger="llmdeploy.router.access")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "llmdeploy.router.access"]

    return lines


@pytest.fixture(scope="session")
def deployment(tiny_llama, tmp_path_factory, stop_at_end):
    """The whole deployment the heavy tests (and the secrets scan after them) run against."""
    from tests.reliability.deployment import start_deployment, stop_deployment

    dep = start_deployment(tmp_path_factory.mktemp("deployment"), tiny_llama)
    stop_at_end(lambda: stop_deployment(dep))
    return dep
