"""Autoscaling through the real CLI: a deployment with `parallel.replicas: {min: 1, max: 2}`, the tiny random
Llama and the fake cloud behind the router. Load that the one engine cannot take spills to the cloud, the
autoscaler adds a replica (the excess keeps going to the cloud while it starts), and once the load stops it
drains one again after the short cool-down. Each change is a `scale` event with its reason."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from llmdeploy.control.supervisor import pid_alive
from tests.control.conftest import ALIAS, Cli, base_spec, wait_for, write_spec
from tests.helpers.fake_cloud import FakeCloud

NAME = "autoscale"
CLOUD_SECRET = "bce-v3/ALTAK-autoscale-cloud-7c1e"


class Load:
    """Client loops in a background thread until stopped: each sends the next request once its last ended."""

    def __init__(self, url: str, clients: int = 6):
        self.url, self.clients = url, clients
        self.stop = threading.Event()
        self.answers: list[tuple[int, str]] = []  # (status, x-llmdeploy-backend)
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        body = {"model": ALIAS, "prompt": "count with me", "max_tokens": 48, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=self.url, timeout=120, trust_env=False) as client:

            async def loop() -> None:
                while not self.stop.is_set():
                    r = await client.post("/v1/completions", json=body)
                    self.answers.append((r.status_code, r.headers.get("x-llmdeploy-backend", "")))

            await asyncio.gather(*(loop() for _ in range(self.clients)))

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(180)


@pytest.fixture(scope="module")
def rig(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("autoscale")
    cloud = FakeCloud(root, expected_key=CLOUD_SECRET).start()
    cloud.control(delay_s=0.05)
    cli = Cli(root / "home", env={"AUTOSCALE_CLOUD_KEY": CLOUD_SECRET})
    spec = base_spec(
        NAME,
        tiny_llama,
        # seconds instead of minutes, so the test sees both changes
        parallel={"replicas": {"min": 1, "max": 2, "scale_up_after_s": 1, "cool_down_s": 3}},
        engine={"max_num_seqs": 2},
        # far over what an engine needs even on a busy machine: the load's spills (a third request in flight on
        # a replica spills, below) move the replicas, not the machine's speed
        sla={"ttft_p99_ms": 30000, "tpot_p99_ms": 60000},
        # the one engine cannot take the load's six clients
        routing={"overflow": {"use_predicted_ttft": False, "max_queue_depth": 1}},
        cloud={
            "enabled": True,
            "provider": "openai-compatible",
            "base_url": f"{cloud.base}/v1",
            "api_key_env": "AUTOSCALE_CLOUD_KEY",
            "model": "ernie-test",
            "max_retries": 1,
            "timeout_s": 10,
        },
    )
    path = write_spec(root / "autoscale.yaml", spec)
    yield {"cli": cli, "file": path, "url": f"http://{spec['listen']}", "cloud": cloud}
    cli.cleanup(NAME)
    cloud.stop()


def scale_events(st: dict) -> list[dict]:
    return [e for e in st["events"] if e["kind"] == "scale"]


def status_when(cli: Cli, condition) -> dict | None:
    st = cli.status(NAME)
    return st if condition(st) else None


def until(cli: Cli, condition, timeout_s: float, what: str) -> dict:
    """The status once `condition` holds; on a timeout the autoscaler's last decision says why not."""
    try:
        return wait_for(lambda: status_when(cli, condition), timeout_s, 0.5, what)
    except AssertionError as e:
        raise AssertionError(f"{e}; the autoscaler: {cli.status(NAME)['autoscale']}") from None


def live_replicas(st: dict) -> list[dict]:
    return [r for r in st["replicas"] if r["revision"] == st["stable"]]


@pytest.mark.slow
def test_scales_up_under_load_and_back_down_after_the_cool_down(rig):
    cli, cloud = rig["cli"], rig["cloud"]
    out = cli.ok("apply", str(rig["file"])).stdout
    assert "1/1 ready (1-2)" in out
    st = cli.status(NAME)
    assert {k: st["autoscale"][k] for k in ("replicas", "min", "max")} == {"replicas": 1, "min": 1, "max": 2}

    with Load(rig["url"]) as load:
        st = until(cli, scale_events, 120, "a scale-up")
        (up,) = scale_events(st)
        assert up["data"]["action"] == "up" and (up["data"]["from"], up["data"]["to"]) == (1, 2)
        assert "SLA at risk for" in up["message"] and up["revision"] == st["stable"]
        cloud_at_up = cloud.stats()["requests"]
        # the new engine loads with no traffic; the excess keeps going to the cloud meanwhile
        both_ready = lambda s: sum(r["ready"] for r in live_replicas(s)) == 2  # noqa: E731
        st = until(cli, both_ready, 180, "the added replica to be ready")
        assert cloud.stats()["requests"] > cloud_at_up
        assert st["autoscale"]["replicas"] == 2 and "2 (1-2)" in cli.ok("status", "--name", NAME).stdout
        pids = {r["replica"]: r["pid"] for r in live_replicas(st)}
        answered_at_two = len(load.answers)
        wait_for(lambda: len(load.answers) > answered_at_two + 10, 60, 0.2, "load on two replicas")

    assert load.answers and all(status == 200 for status, _ in load.answers)
    assert {backend for _, backend in load.answers} == {"local", "cloud"}

    # idle now: after the spill window empties and cool_down_s passes, one replica drains
    scaled_down = lambda s: len(scale_events(s)) == 2 and len(live_replicas(s)) == 1  # noqa: E731
    st = until(cli, scaled_down, 120, "the scale-down")
    down = scale_events(st)[-1]
    assert down["data"]["action"] == "down" and (down["data"]["from"], down["data"]["to"]) == (2, 1)
    assert "idle for" in down["message"] and down["data"]["replica"] in ("r1", "r2")
    assert st["autoscale"]["replicas"] == 1 and live_replicas(st)[0]["ready"]
    text = cli.ok("status", "--name", NAME).stdout
    assert "1 (1-2)" in text and "scale" in text
    history = cli.ok("history", "--name", NAME).stdout
    assert "Scaling" in history and "1 -> 2" in history and "2 -> 1" in history

    # the one left serves, and the drained engine is gone
    r = httpx.post(f"{rig['url']}/v1/completions", json={"model": ALIAS, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-llmdeploy-backend"] == "local"
    drained = pids[down["data"]["replica"]]
    wait_for(lambda: not pid_alive(drained), 60, 0.2, "the drained engine to exit")
