"""`parallel.backend: ray` through the real CLI: a Ray head this module starts on 127.0.0.1 (4 logical CPUs),
a deployment of two replicas of the tiny random Llama placed as Ray actors, and the fake cloud behind the router.
Requests reach both replicas; an actor killed with `ray.kill` is restarted like a crashed engine while requests
keep succeeding, and so is an engine that crashes under its live actor; a canary revision placed on Ray takes its share and is rolled back, freeing its reservation.
The tests share one cluster and one deployment and run in file order; autoscaling on Ray and a killed daemon are
in the `full` tier.

Ray rewrites 127.0.0.1 to the machine's network address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (its
single-machine mode): the head is started with it, and every node must then report 127.0.0.1 before any work is
sent. The head runs as `ray start --block`, so stopping that one process stops exactly this cluster (`ray stop`
would end every Ray process of the machine)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from llmdeploy.control.processes import engine_token
from llmdeploy.control.supervisor import pid_alive
from tests.control.conftest import (
    Cli,
    base_spec,
    port_open,
    revision,
    send_many,
    split_of,
    wait_for,
    write_spec,
)
from tests.helpers.fake_cloud import FakeCloud
from tests.helpers.procs import free_port

pytest.importorskip("ray", reason="the Ray backend's tests need pip install 'llmdeploy[ray]'")

NAME = "onray"
CLOUD_SECRET = "bce-v3/ALTAK-ray-cloud-51c3"
SINGLE_MACHINE = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
RAY = str(Path(sys.executable).with_name("ray"))


def gcs_port() -> int:
    """A free port outside Ray's worker port range (10002-19999), where `ray start --port` refuses it."""
    while not 20000 <= (port := free_port()) < 65000:
        pass
    return port


def ray_script(address: str, body: str, timeout: float = 60) -> dict:
    """Run `body` as a Ray driver in its own process (the pytest process never joins a cluster) and return the
    JSON it prints last; `ray` and `out` (a dict to fill) are in scope."""
    code = (
        "import json, ray\n"
        f"ray.init(address={address!r}, namespace='llmdeploy', logging_level='ERROR', log_to_driver=False)\n"
        "out = {}\n"
        f"{body}\n"
        "print(json.dumps(out))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **SINGLE_MACHINE},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def actors(address: str) -> list[str]:
    """This module's engine actors still alive (named OWNER/revN/rK/n)."""
    return ray_script(
        address,
        "out['names'] = sorted(a['name'] for a in ray.util.list_named_actors(all_namespaces=True)"
        " if a['namespace'] == 'llmdeploy')",
    )["names"]


@pytest.fixture(scope="module")
def ray_cluster():
    """{"address", "temp"}: the head's GCS address and its --temp-dir (sessions, logs)."""
    port = gcs_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port)]
        + ["--num-cpus", "4", "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **SINGLE_MACHINE},
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        wait_for(lambda: port_open(port) or head.poll() is not None, 120, 0.5, "the Ray head to listen")
        assert head.poll() is None, "ray start --head exited"
        nodes = ray_script(
            address, "out['nodes'] = [n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]"
        )["nodes"]
        # loopback only: a node on another address means Ray's traffic left 127.0.0.1; stop here
        assert nodes == ["127.0.0.1"], f"Ray nodes on {nodes}, not loopback only"
        yield {"address": address, "temp": Path(temp)}
    finally:
        head.send_signal(signal.SIGTERM)  # --block: it stops the processes it started, and only those
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head(ray_cluster) -> str:
    return ray_cluster["address"]


@pytest.fixture(scope="module")
def rig(tmp_path_factory, tiny_llama, ray_head, ray_cluster):
    root = tmp_path_factory.mktemp("onray")
    cloud = FakeCloud(root, expected_key=CLOUD_SECRET).start()
    cli = Cli(root / "home", env={"RAY_CLOUD_KEY": CLOUD_SECRET})
    v1 = ray_spec(NAME, tiny_llama, ray_head, cloud, parallel={"replicas": 2})
    # a new revision (engine changed) of one replica that takes half the sessions once ready
    v2 = {
        **v1,
        "engine": {**v1["engine"], "max_num_seqs": 8},
        "parallel": {**v1["parallel"], "replicas": 1},
        "rollout": {"canary_percent": 50},
    }
    files = {"v1": write_spec(root / "v1.yaml", v1), "v2": write_spec(root / "v2.yaml", v2)}
    yield {
        "cli": cli,
        "files": files,
        "url": f"http://{v1['listen']}",
        "address": ray_head,
        "home": root / "home",
        "ray_temp": ray_cluster["temp"],
    }
    cli.cleanup(NAME)
    cloud.stop()


def served_by(rig) -> dict[str, int]:
    """Requests each local replica answered, from the access log lines in the daemon's log."""
    counts: dict[str, int] = {}
    for line in (rig["home"] / NAME / "logs" / "daemon.log").read_text().splitlines():
        if "llmdeploy.router.access" in line and "backend=local" in line and "status=200" in line:
            rep = line.split(" replica=")[1].split()[0]
            counts[rep] = counts.get(rep, 0) + 1
    return counts


def test_plan_shows_the_placement_on_the_cluster(rig):
    r = rig["cli"].ok("plan", str(rig["files"]["v1"]))
    assert f"ray (the Ray cluster at {rig['address']})" in r.stdout
    assert "2 x 1 rank (tensor_parallel)" in r.stdout and "1 CPU (on one node" in r.stdout
    assert "1 node: 4 CPU, 0 GPU" in r.stdout and "room for     4 replicas" in r.stdout
    assert "error" not in r.stderr


def test_apply_places_two_replicas_as_ray_actors(rig):
    out = rig["cli"].ok("apply", str(rig["files"]["v1"])).stdout
    assert "2/2 ready" in out and "placing" in out
    st = rig["cli"].status(NAME)
    assert [(r["revision"], r["replica"], r["ready"]) for r in st["replicas"]] == [
        (1, "r1", True),
        (1, "r2", True),
    ]
    assert all(r["url"].startswith("http://127.0.0.1:") for r in st["replicas"])
    names = actors(rig["address"])
    assert [n.split("/")[1:3] for n in names] == [["rev1", "r1"], ["rev1", "r2"]], names
    # nothing recorded for re-adoption: a Ray replica ends with the daemon's Ray job
    import sqlite3

    with sqlite3.connect(rig["home"] / NAME / "state.db") as db:
        assert db.execute("SELECT COUNT(*) FROM engines").fetchone() == (0,)
    # the internal token reached the engine through its environment, and nothing Ray or we wrote holds it
    token = engine_token(st["replicas"][0]["pid"])
    assert token and token.encode() not in Path(f"/proc/{st['replicas'][0]['pid']}/cmdline").read_bytes()
    for folder in (rig["ray_temp"], rig["home"]):
        for f in folder.rglob("*"):
            if f.is_file() and not f.is_symlink():
                assert token.encode() not in f.read_bytes(), f


def test_requests_succeed_on_both_replicas(rig):
    replies = send_many(rig["url"], [f"s{i}" for i in range(40)], concurrency=8)
    assert {r.status_code for r in replies} == {200}
    assert {r.headers["x-llmdeploy-backend"] for r in replies} == {"local"}
    counts = served_by(rig)
    assert counts.get("r1", 0) > 0 and counts.get("r2", 0) > 0, counts


def test_a_killed_actor_is_restarted_while_requests_keep_succeeding(rig):
    before = next(r for r in rig["cli"].status(NAME)["replicas"] if r["replica"] == "r1")
    victim = next(n for n in actors(rig["address"]) if "/rev1/r1/" in n)
    codes: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            codes.extend(r.status_code for r in send_many(rig["url"], [None] * 4, concurrency=4))

    t = threading.Thread(target=traffic)
    t.start()
    try:
        time.sleep(0.5)
        ray_script(rig["address"], f"ray.kill(ray.get_actor({victim!r}, namespace='llmdeploy'))")

        def restarted():
            r1 = next(r for r in rig["cli"].status(NAME)["replicas"] if r["replica"] == "r1")
            return r1["ready"] and r1["restarts"] == 1 and r1["url"] != before["url"]

        wait_for(restarted, 180, 0.5, "r1 to be restarted on Ray")
        time.sleep(0.5)
    finally:
        stop.set()
        t.join(60)
    assert codes and set(codes) == {200}, sorted(set(codes))
    events = rig["cli"].status(NAME)["events"]
    crash = next(e for e in events if e["kind"] == "engine-crash")
    assert "Ray actor died" in crash["message"] and any(e["kind"] == "engine-restart" for e in events)
    assert not pid_alive(before["pid"])  # the engine died with its actor (same machine here)
    assert victim not in actors(rig["address"])


def test_an_engine_that_crashes_under_its_actor_is_restarted_in_the_same_reservation(rig):
    before = next(r for r in rig["cli"].status(NAME)["replicas"] if r["replica"] == "r2")
    os.kill(before["pid"], signal.SIGKILL)  # the engine, not its actor (same machine here)

    def restarted():
        r2 = next(r for r in rig["cli"].status(NAME)["replicas"] if r["replica"] == "r2")
        return r2["ready"] and r2["restarts"] == 1 and r2["url"] != before["url"]

    wait_for(restarted, 180, 0.5, "r2 to be restarted on Ray")
    crash = [e for e in rig["cli"].status(NAME)["events"] if e["kind"] == "engine-crash"][-1]
    assert "killed by signal 9" in crash["message"]
    # its old actor went with it: one actor per replica, and 2 of the 4 CPUs still free
    assert [n.split("/")[1:3] for n in actors(rig["address"])] == [["rev1", "r1"], ["rev1", "r2"]]
    free = ray_script(rig["address"], "out['cpu'] = ray.available_resources().get('CPU', 0)")["cpu"]
    assert free == 2.0


def test_canary_and_rollback_across_ray_placed_revisions(rig):
    r = rig["cli"].ok("apply", str(rig["files"]["v2"]))
    assert "revision 2 r1: ready" in r.stdout
    st = rig["cli"].status(NAME)
    assert split_of(st) == {1: 50.0, 2: 50.0}
    assert any("/rev2/r1/" in n for n in actors(rig["address"]))
    served = {x.headers["x-llmdeploy-revision"] for x in send_many(rig["url"], [f"c{i}" for i in range(60)])}
    assert served == {"1", "2"}
    r = rig["cli"].ok("rollback")
    assert "candidate revision 2 stopped" in r.stdout
    st = rig["cli"].status(NAME)
    assert split_of(st) == {1: 100.0} and revision(st, 2)["state"] == "rolled-back"
    assert not any("/rev2/" in n for n in actors(rig["address"]))
    # the candidate's reservation is released: 2 of the 4 CPUs are free again
    free = ray_script(rig["address"], "out['cpu'] = ray.available_resources().get('CPU', 0)")["cpu"]
    assert free == 2.0
    served = {x.headers["x-llmdeploy-revision"] for x in send_many(rig["url"], [f"c{i}" for i in range(30)])}
    assert served == {"1"}


def test_down_stops_the_actors_and_frees_the_cluster(rig):
    rig["cli"].ok("down", "--name", NAME)
    assert actors(rig["address"]) == []
    free = ray_script(rig["address"], "out['cpu'] = ray.available_resources().get('CPU', 0)")["cpu"]
    assert free == 4.0


def ray_spec(name: str, model: Path, address: str, cloud: FakeCloud, **over) -> dict:
    return base_spec(
        name,
        model,
        parallel={"backend": "ray", "ray_address": address, **over.pop("parallel", {})},
        cloud={
            "enabled": True,
            "provider": "openai-compatible",
            "base_url": f"{cloud.base}/v1",
            "api_key_env": "RAY_CLOUD_KEY",
            "model": "ernie-test",
            "max_retries": 1,
            "timeout_s": 10,
        },
        **over,
    )


@pytest.mark.slow
@pytest.mark.full  # ~1 min; the autoscaler's moves are covered locally by test_autoscaling.py
def test_autoscaling_adds_and_removes_ray_placed_replicas(tmp_path, tiny_llama, ray_head):
    from tests.control.test_autoscaling import Load

    name = "rayscale"
    cloud = FakeCloud(tmp_path, expected_key=CLOUD_SECRET).start()
    cloud.control(delay_s=0.05)
    cli = Cli(tmp_path / "home", env={"RAY_CLOUD_KEY": CLOUD_SECRET})
    spec = ray_spec(
        name,
        tiny_llama,
        ray_head,
        cloud,
        parallel={"replicas": {"min": 1, "max": 2, "scale_up_after_s": 1, "cool_down_s": 3}},
        engine={"max_num_seqs": 2},
        sla={"ttft_p99_ms": 30000, "tpot_p99_ms": 60000},
        routing={"overflow": {"use_predicted_ttft": False, "max_queue_depth": 1}},
    )
    f = write_spec(tmp_path / "scale.yaml", spec)
    url = f"http://{spec['listen']}"
    ours = lambda: [n for n in actors(ray_head) if n.startswith(f"{name}-")]  # noqa: E731
    try:
        assert "1/1 ready (1-2)" in cli.ok("apply", str(f)).stdout
        assert len(ours()) == 1
        with Load(url) as load:
            wait_for(
                lambda: sum(r["ready"] for r in cli.status(name)["replicas"]) == 2,
                240,
                0.5,
                "a second replica",
            )
            assert len(ours()) == 2
        assert load.answers and all(status == 200 for status, _ in load.answers)
        wait_for(lambda: len(cli.status(name)["replicas"]) == 1, 120, 0.5, "the scale-down")
        wait_for(lambda: len(ours()) == 1, 60, 0.5, "the drained replica's actor to go")
        kinds = [e["data"]["action"] for e in cli.status(name)["events"] if e["kind"] == "scale"]
        assert kinds == ["up", "down"]
        free = ray_script(ray_head, "out['cpu'] = ray.available_resources().get('CPU', 0)")["cpu"]
        assert free == 3.0  # the removed replica's reservation is released
    finally:
        cli.cleanup(name)
        cloud.stop()


@pytest.mark.slow
@pytest.mark.full  # ~40 s; re-adoption of local engines is tested in test_gray_release.py
def test_a_killed_daemon_takes_its_ray_replicas_along_and_apply_starts_them_again(
    tmp_path, tiny_llama, ray_head
):
    name = "raydaemon"
    cloud = FakeCloud(tmp_path, expected_key=CLOUD_SECRET).start()
    cli = Cli(tmp_path / "home", env={"RAY_CLOUD_KEY": CLOUD_SECRET})
    spec = ray_spec(name, tiny_llama, ray_head, cloud, parallel={"replicas": 2})
    f = write_spec(tmp_path / "d.yaml", spec)
    ours = lambda: [n for n in actors(ray_head) if n.startswith(f"{name}-")]  # noqa: E731
    try:
        cli.ok("apply", str(f))
        before = cli.status(name)
        assert len(ours()) == 2
        os.kill(before["daemon"]["pid"], signal.SIGKILL)
        wait_for(lambda: not ours(), 60, 0.5, "the actors to end with the daemon's Ray job")
        wait_for(lambda: not any(pid_alive(r["pid"]) for r in before["replicas"]), 30, 0.2, "engines to exit")
        r = cli.ok("apply", str(f))
        assert "resumed from state.db" in r.stdout and "2/2 ready" in r.stdout
        after = cli.status(name)
        assert {x["url"] for x in after["replicas"]}.isdisjoint({x["url"] for x in before["replicas"]})
        assert not any(e["kind"] == "engine-adopted" for e in after["events"])
        replies = send_many(f"http://{spec['listen']}", [f"k{i}" for i in range(10)])
        assert {x.status_code for x in replies} == {200}
    finally:
        cli.cleanup(name)
        cloud.stop()
