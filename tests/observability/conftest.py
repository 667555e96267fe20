"""One real deployment for the observability tests (dashboard in a browser, metrics, status, bench): the CLI as a
subprocess, the tiny random Llama, the fake cloud for the spill, an API key from the environment and a cost:
section. Stable revision 1 serves; `ensure_candidate` starts a candidate revision when a test needs one."""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx
import pytest

from tests.control.conftest import ALIAS, Cli, base_spec, write_spec
from tests.helpers.fake_cloud import FakeCloud

NAME = "obs"
CLIENT_KEY = "sk-obs-dashboard-key-7d2c91"
CLOUD_KEY = "bce-obs-cloud-key-11aa"
ENV = {"OBS_KEY": CLIENT_KEY, "OBS_CLOUD_KEY": CLOUD_KEY}
PRICES = {"cloud_input_per_1m": 0.5, "cloud_output_per_1m": 1.5, "local_per_hour": 1.2, "currency": "USD"}
HEADERS = {"authorization": f"Bearer {CLIENT_KEY}"}
# each candidate differs in engine.max_num_seqs: a new revision each time
_candidate_seqs = itertools.count(8)


@pytest.fixture(scope="session")
def obs(tmp_path_factory, tiny_llama, stop_at_end):
    root = tmp_path_factory.mktemp("obs")
    cloud = FakeCloud(root, expected_key=CLOUD_KEY).start()
    cli = Cli(root / "home", env=ENV)
    v1 = base_spec(
        NAME,
        tiny_llama,
        auth={"api_key_required": True, "keys": [{"name": "ops", "key_env": "OBS_KEY"}]},
        cloud={
            "enabled": True,
            "provider": "openai-compatible",
            "base_url": f"{cloud.base}/v1",
            "api_key_env": "OBS_CLOUD_KEY",
            "model": "ernie-test",
            "max_retries": 1,
            "timeout_s": 10,
        },
        # a burst above 2 requests/s spills to the (fake) cloud: the tests see both backends
        routing={
            "burst": {"local_rps": 2},
            "overflow": {"use_predicted_ttft": False, "max_queue_depth": 4096},
        },
        sla={"ttft_p99_ms": 60000, "tpot_p99_ms": 60000},  # never judged slow: the burst alone spills
        cost=PRICES,
    )
    rig = {"cli": cli, "root": root, "spec": v1, "url": f"http://{v1['listen']}", "cloud": cloud}
    rig["v1"] = write_spec(root / "v1.yaml", v1)

    def stop() -> None:
        cli.cleanup(NAME)
        cloud.stop()

    stop_at_end(stop)  # registered first: a failed apply is cleaned up too
    cli.ok("apply", str(rig["v1"]))
    return rig


def ensure_candidate(rig) -> int:
    """A ready candidate revision at 0% (a new one when none is listed); returns its id."""
    st = rig["cli"].status(NAME)
    if st["candidate"] is not None:
        if st["split"].get(str(st["candidate"])):
            rig["cli"].ok("canary", "--percent", "0")
        return st["candidate"]
    spec = {**rig["spec"], "engine": {**rig["spec"]["engine"], "max_num_seqs": next(_candidate_seqs)}}
    path = write_spec(rig["root"] / f"cand-{spec['engine']['max_num_seqs']}.yaml", spec)
    rig["cli"].ok("apply", str(path))
    st = rig["cli"].status(NAME)
    assert st["candidate"] is not None, st["revisions"]
    return st["candidate"]


async def _send(url: str, n: int, stream: bool, max_tokens: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=HEADERS, trust_env=False) as client:

        async def one(i: int) -> httpx.Response:
            body = {"model": ALIAS, "prompt": f"hello {i}", "max_tokens": max_tokens, "stream": stream}
            r = await client.post("/v1/completions", json=body, headers={"x-session-id": f"s{i}"})
            await r.aread()
            return r

        return await asyncio.gather(*(one(i) for i in range(n)))


def traffic(rig, n: int = 24, stream: bool = True, max_tokens: int = 4) -> list[httpx.Response]:
    """n requests at once: about 2 local (local_rps 2), the rest spill to the fake cloud."""
    time.sleep(1.5)  # the burst bucket refills (2 requests of room) after the previous call's spill
    responses = asyncio.run(_send(rig["url"], n, stream, max_tokens))
    assert [(r.status_code, r.text[:200]) for r in responses if r.status_code != 200] == []
    return responses


__all__ = ["ALIAS", "CLIENT_KEY", "HEADERS", "NAME", "PRICES", "ensure_candidate", "traffic"]
