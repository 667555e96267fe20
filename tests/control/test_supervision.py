"""Supervision and automatic rollback, through the real CLI: two replicas and the fake cloud behind the router;
kill -9 of an engine, a candidate that cannot start, a candidate that breaks its limits, secrets hygiene and
--foreground. The tests share one deployment and run in file order."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from llmdeploy.control.supervisor import pid_alive
from tests.control.conftest import (
    ALIAS,
    LLMDEPLOY,
    Cli,
    base_spec,
    pids_of,
    port_open,
    revision,
    send_many,
    split_of,
    wait_for,
    write_spec,
)
from tests.helpers.fake_cloud import FakeCloud
from tests.helpers.safetensors_files import write_safetensors

NAME = "sup"
CLIENT_SECRET = "sk-client-secret-4f1d9a7e2c"
CLOUD_SECRET = "bce-v3/ALTAK-cloud-secret-88b2"
ENV = {"SUP_APP_KEY": CLIENT_SECRET, "SUP_CLOUD_KEY": CLOUD_SECRET}


@pytest.fixture(scope="module")
def rig(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("sup")
    cloud = FakeCloud(root, expected_key=CLOUD_SECRET).start()
    cli = Cli(root / "home", env=ENV)
    v1 = base_spec(
        NAME,
        tiny_llama,
        parallel={"replicas": 2},
        auth={"api_key_required": True, "keys": [{"name": "app", "key_env": "SUP_APP_KEY"}]},
        cloud={
            "enabled": True,
            "provider": "openai-compatible",
            "base_url": f"{cloud.base}/v1",
            "api_key_env": "SUP_CLOUD_KEY",
            "model": "ernie-test",
            "max_retries": 1,
            "timeout_s": 10,
        },
    )
    broken_model = root / "broken-model"
    shutil.copytree(tiny_llama, broken_model)
    # a whole safetensors file (validate reads its header) whose one tensor the model has no place for
    write_safetensors(broken_model / "model.safetensors", {"junk": [1]})
    broken = {**v1, "model": {**v1["model"], "path": str(broken_model)}, "parallel": {"replicas": 1}}
    # refused for want of memory, which another try might find: retried, unlike a model that cannot load
    hungry = {
        **v1,
        "engine": {**v1["engine"], "device": "cpu", "kv_cache_gb": 1e6},
        "parallel": {"replicas": 1},
    }
    failing = {
        **v1,
        "parallel": {"replicas": 1},
        # the candidate "breaks its SLA" on every request: a TTFT limit no engine can meet
        "rollout": {
            "canary_percent": 50,
            "auto_rollback": {"max_ttft_p99_ms": 0.001, "min_requests": 10, "window_s": 30},
        },
    }
    files = {
        "v1": write_spec(root / "v1.yaml", v1),
        "broken": write_spec(root / "broken.yaml", broken),
        "hungry": write_spec(root / "hungry.yaml", hungry),
        "failing": write_spec(root / "failing.yaml", failing),
    }
    yield {"cli": cli, "files": files, "url": f"http://{v1['listen']}", "cloud": cloud, "root": root}
    cli.cleanup(NAME)
    cli.cleanup("fg")
    cloud.stop()


HEADERS = {"authorization": f"Bearer {CLIENT_SECRET}"}


def test_apply_with_two_replicas_and_the_cloud(rig):
    out = rig["cli"].ok("apply", str(rig["files"]["v1"])).stdout
    assert "2/2 ready" in out and "cloud         on" in out
    assert "sk-llmd-" not in out  # the key comes from SUP_APP_KEY: nothing generated
    st = rig["cli"].status(NAME)
    assert [(r["revision"], r["replica"], r["ready"]) for r in st["replicas"]] == [
        (1, "r1", True),
        (1, "r2", True),
    ]


def running_on(url: str) -> int:
    try:
        return int(httpx.get(f"{url}/load", timeout=2).json().get("running", 0))
    except (httpx.HTTPError, ValueError):
        return 0


def failovers_from_local(router_url: str) -> float:
    text = httpx.get(f"{router_url}/metrics", headers=HEADERS, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llmdeploy_router_failovers_total{") and 'from_backend="local"' in line
    )


def test_kill_9_of_an_engine_restarts_it_while_requests_keep_succeeding(rig):
    st = rig["cli"].status(NAME)
    victim = next(r for r in st["replicas"] if r["replica"] == "r1")
    codes: list[int] = []
    backends: list[str] = []
    long_codes: list[int] = []
    stop = threading.Event()
    failovers_before = failovers_from_local(rig["url"])

    def traffic() -> None:
        while not stop.is_set():
            for r in send_many(rig["url"], [None] * 4, HEADERS, concurrency=4):
                codes.append(r.status_code)
                backends.append(r.headers.get("x-llmdeploy-backend", "?"))

    def long_requests() -> None:  # whole answers (not streams): the router may still move them elsewhere
        body = {"model": ALIAS, "prompt": "hi", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
        while not stop.is_set():
            r = httpx.post(f"{rig['url']}/v1/completions", json=body, headers=HEADERS, timeout=120)
            long_codes.append(r.status_code)

    threads = [threading.Thread(target=traffic), *(threading.Thread(target=long_requests) for _ in range(4))]
    for t in threads:
        t.start()
    try:
        # the kill lands while the victim decodes: a crash between requests would prove nothing about them
        wait_for(lambda: running_on(victim["url"]) >= 2, 60, 0.002, "the victim to run two requests")
        os.kill(victim["pid"], signal.SIGKILL)

        def restarted():
            r1 = next(r for r in rig["cli"].status(NAME)["replicas"] if r["replica"] == "r1")
            return r1["ready"] and r1["pid"] != victim["pid"] and r1["restarts"] == 1

        wait_for(restarted, 180, 0.5, "r1 to be restarted")
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert codes and set(codes) == {200}, sorted(set(codes))
    assert long_codes and set(long_codes) == {200}, sorted(set(long_codes))
    # the requests the kill cut were answered by another backend, before the client saw anything
    assert failovers_from_local(rig["url"]) > failovers_before
    st = rig["cli"].status(NAME)
    kinds = [(e["kind"], e["revision"]) for e in st["events"]]
    assert ("engine-crash", 1) in kinds and ("engine-restart", 1) in kinds
    # how long the restart took, spawn to ready: in the event and on the replica
    restart = next(e for e in st["events"] if e["kind"] == "engine-restart")
    r1 = next(r for r in st["replicas"] if r["replica"] == "r1")
    assert restart["data"]["start_s"] == r1["start_s"] > 0
    assert f"restarted and ready in {r1['start_s']:g} s" in restart["message"]
    assert not pid_alive(victim["pid"])
    print(
        f"{len(codes)} short and {len(long_codes)} long requests during the crash; backends: {sorted(set(backends))}"
    )


def events_of(st: dict, rev: int, kind: str) -> list[dict]:
    return [e for e in st["events"] if e["kind"] == kind and e["revision"] == rev]


def test_a_candidate_that_cannot_load_its_model_fails_at_once_and_stable_keeps_serving(rig):
    r = rig["cli"].run("apply", str(rig["files"]["broken"]))
    assert r.returncode == 1 and "revision 2 failed to start" in r.stderr, r.stderr
    assert "failed to start: failed: cannot load its model (exited with code 78)" in r.stderr, r.stderr
    assert "has no place in" in r.stderr  # the engine's own words, from its log's tail
    st = rig["cli"].status(NAME)
    assert revision(st, 2)["state"] == "failed" and split_of(st) == {1: 100.0}
    assert pids_of(st, 2) == []
    (failed,) = events_of(st, 2, "engine-failed")
    # the engine said its model cannot load (exit 78): no restart would help, so there was none
    assert "cannot load its model (exited with code 78); giving up" in failed["message"], failed
    assert "has no place in" in failed["data"]["log_tail"] and events_of(st, 2, "engine-crash") == []
    assert {x.status_code for x in send_many(rig["url"], ["a", "b", "c"], HEADERS)} == {200}


def test_a_candidate_crashing_before_ready_is_retried_then_given_up(rig):
    r = rig["cli"].run("apply", str(rig["files"]["hungry"]))
    assert r.returncode == 1 and "revision 3 failed to start" in r.stderr, r.stderr
    assert "exited with code 1 3 times before becoming ready" in r.stderr, r.stderr
    st = rig["cli"].status(NAME)
    assert revision(st, 3)["state"] == "failed" and split_of(st) == {1: 100.0}
    (failed,) = events_of(st, 3, "engine-failed")
    assert "exited with code 1 3 times before becoming ready; giving up" in failed["message"], failed
    assert "more than this machine's available memory" in failed["data"]["log_tail"]
    assert [e["data"]["crashes_in_a_row"] for e in events_of(st, 3, "engine-crash")] == [1, 2]


def test_a_candidate_breaking_its_limits_is_rolled_back_automatically(rig):
    rig["cli"].ok("apply", str(rig["files"]["failing"]))
    st = rig["cli"].status(NAME)
    assert split_of(st) == {1: 50.0, 4: 50.0}  # rollout.canary_percent once ready
    candidate_pids = pids_of(st, 4)

    def rolled_back():
        send_many(rig["url"], [f"s{i}" for i in range(20)], HEADERS, stream=True)
        return revision(rig["cli"].status(NAME), 4)["state"] == "rolled-back"

    wait_for(rolled_back, 120, 0.5, "the automatic rollback")
    st = rig["cli"].status(NAME)
    assert split_of(st) == {1: 100.0}
    event = next(e for e in st["events"] if e["kind"] == "auto-rollback")
    assert event["revision"] == 4 and "TTFT p99" in event["message"]
    numbers = event["data"]
    assert numbers["requests"] >= 10 and numbers["ttft_p99_ms"] > numbers["max_ttft_p99_ms"] == 0.001
    assert "automatic: TTFT p99" in revision(st, 4)["reason"]
    assert "last auto-rollback" in rig["cli"].ok("status").stdout.replace("\n", " ")
    wait_for(
        lambda: not any(pid_alive(p) for p in candidate_pids), 30, what="the candidate's engines to stop"
    )
    r = rig["cli"].run("apply", str(rig["files"]["failing"]))
    assert r.returncode == 1 and "roll forward again" in r.stderr


def test_secrets_never_reach_state_logs_status_or_engines(rig):
    home = rig["cli"].home / NAME
    blobs = [p.read_bytes() for p in home.rglob("*") if p.is_file() and p.suffix != ".sock"]
    blobs += [
        rig["cli"].ok(*args).stdout.encode()
        for args in (("status", "--json"), ("status",), ("history", "--json"), ("logs", "--lines", "500"))
    ]
    for secret in (CLIENT_SECRET, CLOUD_SECRET):
        assert not any(secret.encode() in b for b in blobs), secret
    assert any(b"SUP_APP_KEY" in b for b in blobs)  # stored by name
    for pid in pids_of(rig["cli"].status(NAME), 1):
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert CLIENT_SECRET.encode() not in environ and CLOUD_SECRET.encode() not in environ


@pytest.mark.full  # CI's time budget: scripts/test.sh -m full
def test_foreground_runs_attached_and_drains_on_sigterm(rig, tiny_llama):
    if not (rig["cli"].home / NAME / "state.db").exists():  # run alone (-m full): `status` below needs two
        rig["cli"].ok("apply", str(rig["files"]["v1"]))
    spec = base_spec("fg", tiny_llama)
    path = write_spec(rig["root"] / "fg.yaml", spec)
    port = int(spec["listen"].split(":")[1])
    proc = subprocess.Popen(
        [LLMDEPLOY, "apply", "--foreground", str(path)],
        env=rig["cli"].env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: (rig["cli"].home / "fg" / "admin.sock").exists(), 60, what="the foreground daemon")
        wait_for(
            lambda: (
                all(r["ready"] for r in rig["cli"].status("fg")["replicas"])
                and rig["cli"].status("fg")["replicas"]
            ),
            90,
            0.5,
            "fg ready",
        )
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"model": ALIAS, "prompt": "hi", "max_tokens": 1}
        )
        assert r.status_code == 200
        several = rig["cli"].run("status")
        assert several.returncode == 1 and "several deployments" in several.stderr
        engine_pids = pids_of(rig["cli"].status("fg"), 1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "running in the foreground" in out
    assert not port_open(port) and not any(pid_alive(p) for p in engine_pids)
    assert rig["cli"].status("fg")["daemon"]["running"] is False
