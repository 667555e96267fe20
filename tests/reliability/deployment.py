"""A whole deployment for the heavy reliability tests, made the way a user makes one: `llmdeploy apply` of a YAML
with keys from env vars, the cloud on (the fake cloud, on loopback) and the tiny Llama as the model.

Every secret in it is a random marker made for this run (client key, cloud key), and every prompt the tests
send carries PROMPT_MARKER, so the scan at the end can look for them in the logs and the state directory.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from llmdeploy.control.processes import engine_token
from tests.control.conftest import ALIAS, Cli, base_spec, wait_for, write_spec
from tests.helpers.fake_cloud import FakeCloud
from tests.router.conftest import deep_merge

NAME = "rel"
CLIENT_MARKER = "sk-rel-" + secrets.token_hex(12)
CLOUD_MARKER = "cloud-rel-" + secrets.token_hex(12)
PROMPT_MARKER = "promptmarker" + secrets.token_hex(6)
ENV = {"REL_APP_KEY": CLIENT_MARKER, "REL_CLOUD_KEY": CLOUD_MARKER}


@dataclass
class Deployment:
    root: Path
    cli: Cli
    cloud: FakeCloud
    url: str
    marks: dict[str, Any] = field(default_factory=dict)  # figures the tests record for bench/RESULTS.md

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {CLIENT_MARKER}"}

    def status(self) -> dict:
        return self.cli.status(NAME)

    def engine(self) -> dict:
        (rep,) = [r for r in self.status()["replicas"] if r["ready"]]
        return rep

    def engine_headers(self) -> dict[str, str]:
        """The internal token, as only a process of the same user can read it (from /proc); never shown."""
        token = engine_token(self.engine()["pid"])
        assert token, "the daemon's engine has no internal token"
        return {"x-llmdeploy-engine-token": token}

    def daemon_pid(self) -> int:
        return self.status()["daemon"]["pid"]

    def wait_engine_ready(self, timeout_s: float = 180, not_pid: int | None = None) -> dict:
        """A ready replica; with `not_pid`, another process than that one (status may still list a killed engine
        as ready until the supervisor notices)."""
        return wait_for(
            lambda: next((r for r in self.status()["replicas"] if r["ready"] and r["pid"] != not_pid), None),
            timeout_s,
            0.5,
            "the engine to be ready",
        )

    def wait_engine_idle(self, timeout_s: float = 60) -> dict:
        url = self.engine()["url"]

        def idle() -> dict | None:
            load = httpx.get(f"{url}/load", timeout=5).json()
            return load if load["running"] == 0 and load["waiting"] == 0 else None

        return wait_for(idle, timeout_s, 0.2, "the engine to be idle")


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def chat(text: str, **kw: Any) -> dict:
    return {"model": ALIAS, "messages": [{"role": "user", "content": f"{PROMPT_MARKER} {text}"}], **kw}


def completion(text: str, **kw: Any) -> dict:
    return {"model": ALIAS, "prompt": f"{PROMPT_MARKER} {text}", **kw}


def start_deployment(root: Path, model: Path) -> Deployment:
    cloud = FakeCloud(root, expected_key=CLOUD_MARKER).start()
    spec = base_spec(
        NAME,
        model,
        auth={"api_key_required": True, "keys": [{"name": "app", "key_env": "REL_APP_KEY"}]},
        engine={"kv_cache_gb": 0.02, "max_num_seqs": 8},
        cloud={
            "enabled": True,
            "provider": "openai-compatible",
            "base_url": f"{cloud.base}/v1",
            "api_key_env": "REL_CLOUD_KEY",
            "model": "ernie-rel",
            "max_retries": 1,
            "timeout_s": 120,
        },
    )
    spec = deep_merge(
        spec,
        {
            "sla": {"ttft_p99_ms": 600_000, "tpot_p99_ms": 600_000},  # a tiny model on a busy CPU: stay local
            "routing": {
                "local_wait_s": 300,  # never shed on a predicted wait: the machine is slow, not the deployment
                "continue_on_failure": "cloud",
                "burst": {"local_rps": 50},
                "overflow": {"use_predicted_ttft": False, "max_queue_depth": 16},
            },
        },
    )
    cli = Cli(root / "home", env=ENV)
    cli.ok("apply", str(write_spec(root / "llmdeploy.yaml", spec)), timeout=600)
    dep = Deployment(root, cli, cloud, f"http://{spec['listen']}")
    dep.wait_engine_ready()
    return dep


def stop_deployment(dep: Deployment) -> None:
    dep.cli.cleanup(NAME)
    dep.cloud.stop()


def full_or(small: int, full: int) -> int:
    return full if os.environ.get("LLMDEPLOY_RELIABILITY_FULL") == "1" else small
