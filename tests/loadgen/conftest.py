"""Live targets for bench: a real engine on a tiny random model, the real fake cloud, and the standalone router
in front of both, each its own process on 127.0.0.1; the router's YAML is the one `--sla-from` reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.fake_cloud import FakeCloud
from tests.helpers.procs import ServerProcess, free_port

ALIAS = "tiny-chat"
CLOUD_REPLY_TOKENS = 5  # the fake cloud's default reply, "Hello from the fake cloud", one token a word
CLOUD_KEY = "bce-v3/ALTAK-bench-cloud-secret"
BENCH_KEY = "sk-bench-0123456789abcdef-secret"
TIGHT_KEY = "sk-bench-tight-fedcba9876543210"  # its own key name, limited to 1 request per minute
ENV = {"BENCH_KEY": BENCH_KEY, "TIGHT_KEY": TIGHT_KEY, "CLOUD_KEY": CLOUD_KEY}
ENGINE_ARGS = [
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "256",
    "--kv-cache-gb",
    "0.01",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--seed",
    "0",
]


@dataclass
class Deployment:
    engine_url: str
    router_url: str
    cloud: FakeCloud
    spec_path: Path


@pytest.fixture(scope="session")
def bench_engine(tiny_llama, tmp_path_factory, stop_at_end):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        "-m",
        "llmdeploy.engine",
        "--model",
        str(tiny_llama),
        "--served-alias",
        ALIAS,
        "--port",
        str(port),
        *ENGINE_ARGS,
    ]
    proc = ServerProcess(
        args, f"{url}/health", tmp_path_factory.mktemp("bench-engine") / "engine.log"
    ).start()
    stop_at_end(proc.stop)
    return url


@pytest.fixture(scope="session")
def bench_cloud(tmp_path_factory):
    fc = FakeCloud(tmp_path_factory.mktemp("bench-cloud"), expected_key=CLOUD_KEY).start()
    yield fc
    fc.stop()


def spec_yaml(model: Path, port: int, cloud_url: str) -> str:
    # local_rps 1: arrivals beyond one a second (a token bucket) overflow to the cloud, so a burst splits
    return f"""\
name: bench-test
model: {{path: {model}, served_alias: {ALIAS}, max_model_len: 512}}
listen: 127.0.0.1:{port}
auth:
  keys:
    - {{name: app, key_env: BENCH_KEY}}
    - {{name: tight, key_env: TIGHT_KEY, rpm: 1}}
sla: {{ttft_p99_ms: 60000, tpot_p99_ms: 60000}}
routing: {{burst: {{local_rps: 1}}}}
cloud: {{enabled: true, provider: openai-compatible, base_url: "{cloud_url}", api_key_env: CLOUD_KEY,
        model: ernie-test, max_retries: 0, timeout_s: 30}}
"""


@pytest.fixture(scope="session")
def deployment(bench_engine, bench_cloud, tiny_llama, tmp_path_factory, stop_at_end):
    d = tmp_path_factory.mktemp("bench-router")
    port = free_port()
    spec = d / "llmdeploy.yaml"
    spec.write_text(spec_yaml(tiny_llama, port, f"{bench_cloud.base}/v1"))
    url = f"http://127.0.0.1:{port}"
    args = ["-m", "llmdeploy.router", "--config", str(spec), "--engine", bench_engine]
    proc = ServerProcess(args, f"{url}/health", d / "router.log", env=ENV).start()
    stop_at_end(proc.stop)
    return Deployment(bench_engine, url, bench_cloud, spec)
