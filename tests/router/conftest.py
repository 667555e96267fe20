"""Router test rig: fake cloud and fake engine as real processes, the router in a uvicorn thread on loopback."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from llmdeploy.router import create_router
from llmdeploy.router.table import EngineEndpoint, RevisionRoute, RoutingTable
from llmdeploy.spec.models import DeploymentSpec
from tests.helpers.fake_cloud import FakeCloud
from tests.helpers.procs import free_port

ALIAS = "chat-model-v1"
CLIENT_KEY = "sk-client-0123456789abcdef"
LOCAL_ONLY_KEY = "sk-localonly-fedcba9876543210"
CLOUD_KEY = "bce-v3/ALTAK-cloud-secret-key-42"
ENV = {"APP_KEY": CLIENT_KEY, "LOCAL_KEY": LOCAL_ONLY_KEY, "CLOUD_KEY": CLOUD_KEY}


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def spec_dict(cloud_url: str | None = None, **over: Any) -> dict:
    base = {
        "model": {"served_alias": ALIAS},
        "auth": {
            "api_key_required": True,
            "keys": [
                {"name": "app", "key_env": "APP_KEY"},
                {"name": "private", "key_env": "LOCAL_KEY", "allow_cloud": False},
            ],
        },
        "sla": {"ttft_p99_ms": 1000},
        "routing": {"local_wait_s": 0.5, "burst": {"local_rps": 1000}},
        "cloud": {
            "enabled": cloud_url is not None,
            "provider": "openai-compatible",
            "base_url": cloud_url or "http://127.0.0.1:9/v1",
            "api_key_env": "CLOUD_KEY",
            "model": "ernie-4.5-turbo-128k",
            "max_retries": 2,
            "timeout_s": 10,
        },
    }
    return deep_merge(base, over)


def make_spec(cloud_url: str | None = None, **over: Any) -> DeploymentSpec:
    return DeploymentSpec.model_validate(spec_dict(cloud_url, **over))


class RouterServer:
    """A Router served by uvicorn in a thread (own event loop) on a free loopback port."""

    def __init__(
        self,
        spec: DeploymentSpec,
        engines: list[str],
        *,
        revision: int = 1,
        environ: dict | None = None,
        tls: tuple[str, str] | None = None,
        table: RoutingTable | None = None,
        **router_kw: Any,
    ) -> None:
        self.table = table or RoutingTable(
            [
                RevisionRoute(
                    revision,
                    "stable",
                    100.0,
                    [EngineEndpoint(u, f"r{i + 1}", True) for i, u in enumerate(engines)],
                )
            ]
        )
        router_kw.setdefault("poll_interval_s", 0.05)
        router_kw.setdefault("cloud_backoff_s", 0.02)
        self.router = create_router(
            spec, self.table, environ=ENV if environ is None else environ, **router_kw
        )
        self.port = free_port()
        ssl = {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]} if tls else {}
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.router.app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                access_log=False,
                **ssl,
            )
        )
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.server.serve())

    def start(self) -> RouterServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("router did not start")
            time.sleep(0.01)
        return self

    def call(self, fn, *args):
        """Run fn(*args) on the router's loop (for update_spec and friends) and wait for it."""

        async def run():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture(scope="session")
def cloud(tmp_path_factory):
    fc = FakeCloud(tmp_path_factory.mktemp("cloud"), expected_key=CLOUD_KEY).start()
    yield fc
    fc.stop()


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    """A fake local engine: OpenAI API plus a /load the test sets."""
    fe = FakeCloud(tmp_path_factory.mktemp("engine")).start()
    yield fe
    fe.stop()


@pytest.fixture
def fakes(cloud, engine):
    cloud.reset()
    engine.reset()
    engine.control(reply="Hello from the local engine")
    return cloud, engine


@pytest.fixture
def start_router():
    started: list[RouterServer] = []

    def start(spec: DeploymentSpec, engines: list[str], **kw: Any) -> RouterServer:
        rs = RouterServer(spec, engines, **kw).start()
        started.append(rs)
        return rs

    yield start
    for rs in started:
        rs.stop()


def client(rs: RouterServer, key: str | None = CLIENT_KEY, **kw: Any) -> httpx.Client:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=rs.url, headers=headers, timeout=30, **kw)


def chat_body(text: str = "Hi there", **kw: Any) -> dict:
    return {"model": ALIAS, "messages": [{"role": "user", "content": text}], **kw}


def sse_events(resp: httpx.Response) -> list[Any]:
    import json

    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def cloud_url(fc: FakeCloud) -> str:
    return f"{fc.base}/v1"


def wait_until(pred, timeout_s: float = 30.0, every_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every_s)
    return pred()


@pytest.fixture(scope="session")
def self_signed(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1/localhost, made with the openssl CLI at test time."""
    import subprocess

    d = Path(tmp_path_factory.mktemp("tls"))
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)
