"""A gray release end to end, through the real `llmdeploy` CLI: apply v1, hot reload, apply v2 (an engine change),
canary 10 (sticky split, pin header), rollback, roll forward with --force, promote, undo, kill -9 of the daemon,
down and back. The tests share one deployment and run in file order; each asserts one step's behaviour."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest
import yaml
from openai import OpenAI

from llmdeploy.control.supervisor import pid_alive
from llmdeploy.policies.split import sticky_bucket
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
from tests.helpers.procs import ctrl_c_works, free_port

NAME = "gray"


@pytest.fixture(scope="module")
def rig(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("gray")
    cli = Cli(root / "home")
    v1 = base_spec(NAME, tiny_llama, auth={"api_key_required": True})  # no keys: apply generates one
    files = {
        "v1": write_spec(root / "v1.yaml", v1),
        "v1b": write_spec(root / "v1b.yaml", {**v1, "sla": {"ttft_p99_ms": 2500}}),  # hot: router only
        "v2": write_spec(
            root / "v2.yaml",
            {**v1, "sla": {"ttft_p99_ms": 2500}, "engine": {**v1["engine"], "max_num_seqs": 8}},
        ),
        "invalid": write_spec(root / "bad.yaml", {**v1, "engine": {"max_num_seqs": 0, "blok_size": 16}}),
    }
    files["v2c30"] = write_spec(
        root / "v2c30.yaml", {**yaml.safe_load(files["v2"].read_text()), "rollout": {"canary_percent": 30}}
    )
    rig = {
        "cli": cli,
        "files": files,
        "url": f"http://{v1['listen']}",
        "port": int(v1["listen"].split(":")[1]),
    }
    yield rig
    cli.cleanup(NAME)


def headers(rig) -> dict[str, str]:
    return {"authorization": f"Bearer {rig['key']}"}


def test_invalid_file_before_anything_creates_nothing(rig):
    r = rig["cli"].run("apply", str(rig["files"]["invalid"]))
    assert r.returncode == 2
    assert "engine.max_num_seqs" in r.stdout and "blok_size" in r.stdout
    assert not (rig["cli"].home / NAME).exists()


def test_apply_starts_the_deployment_and_serves_chat(rig):
    # two applies at once: the lock serialises them; one starts everything, the other then finds it unchanged
    procs = [
        subprocess.Popen(
            [LLMDEPLOY, "apply", str(rig["files"]["v1"])],
            env=rig["cli"].env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    outs = [(p.communicate(timeout=240), p.returncode) for p in procs]
    assert [code for _, code in outs] == [0, 0], outs
    (out, _), (other, other_err) = sorted((o for o, _ in outs), key=lambda o: "unchanged" in o[0])
    assert other.strip() == f"{NAME}: unchanged" and "waiting for another llmdeploy command" in other_err
    for progress in ("loading weights", "KV cache", "tokens", "ready", "router listening on"):
        assert progress in out, out
    assert "served alias" in out and ALIAS in out and "curl " in out
    keys = re.findall(r"sk-llmd-[A-Za-z0-9_-]+", out + other)
    assert len(keys) == 1, out  # printed once
    rig["key"] = keys[0]
    client = OpenAI(base_url=f"{rig['url']}/v1", api_key=rig["key"], max_retries=0)
    chat = client.chat.completions.create(
        model=ALIAS, messages=[{"role": "user", "content": "Hello"}], max_tokens=4
    )
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens >= 1
    bad = httpx.post(
        f"{rig['url']}/v1/completions",
        json={"model": ALIAS, "prompt": "x"},
        headers={"authorization": "Bearer nope"},
    )
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    st = rig["cli"].status(NAME)
    assert split_of(st) == {1: 100.0} and revision(st, 1)["state"] == "serving"
    db = (rig["cli"].home / NAME / "state.db").read_bytes()
    assert rig["key"].encode() not in db


def test_second_apply_is_unchanged_and_prints_no_key(rig):
    r = rig["cli"].ok("apply", str(rig["files"]["v1"]))
    assert r.stdout.strip() == f"{NAME}: unchanged"


def test_canary_is_refused_without_a_candidate(rig):
    r = rig["cli"].run("canary", "--percent", "10")
    assert r.returncode == 1 and "no candidate revision" in r.stderr


def test_hot_reload_drops_no_request(rig):
    results: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client(base_url=rig["url"], headers=headers(rig), timeout=60) as c:
            while not stop.is_set():
                r = c.post("/v1/completions", json={"model": ALIAS, "prompt": "hi", "max_tokens": 1})
                results.append(r.status_code)

    t = threading.Thread(target=traffic)
    t.start()
    try:
        time.sleep(0.3)
        r = rig["cli"].ok("apply", str(rig["files"]["v1b"]))
        time.sleep(0.3)
    finally:
        stop.set()
        t.join(30)
    assert "hot reload" in r.stdout
    assert results and set(results) == {200}, results
    st = rig["cli"].status(NAME)
    assert [x["id"] for x in st["revisions"]] == [1] and split_of(st) == {1: 100.0}


def test_dry_run_shows_the_diff_and_changes_nothing(rig):
    r = rig["cli"].ok("apply", str(rig["files"]["v2"]), "--dry-run")
    assert (
        "- engine.max_num_seqs: 16" in r.stdout and "+ engine.max_num_seqs: 8    (new-revision)" in r.stdout
    )
    assert "apply would: new revision" in r.stdout
    assert [x["id"] for x in rig["cli"].status(NAME)["revisions"]] == [1]


def test_engine_change_starts_revision_2_at_zero_percent(rig):
    r = rig["cli"].ok("apply", str(rig["files"]["v2"]))
    assert "new revision" in r.stdout and "revision 2 r1: ready" in r.stdout
    st = rig["cli"].status(NAME)
    assert split_of(st) == {1: 100.0, 2: 0.0}
    assert revision(st, 2)["state"] == "ready" and revision(st, 1)["state"] == "serving"
    served = {
        resp.headers["x-llmdeploy-revision"]
        for resp in send_many(rig["url"], [f"s{i}" for i in range(40)], headers(rig))
    }
    assert served == {"1"}


def test_invalid_file_while_running_changes_nothing(rig):
    before = rig["cli"].status(NAME)
    r = rig["cli"].run("apply", str(rig["files"]["invalid"]))
    assert r.returncode == 2
    after = rig["cli"].status(NAME)
    assert [(x["id"], x["state"]) for x in after["revisions"]] == [
        (x["id"], x["state"]) for x in before["revisions"]
    ]
    assert split_of(after) == split_of(before)


def test_canary_10_percent_is_sticky_per_session(rig):
    r = rig["cli"].ok("canary", "--percent", "10")
    assert "candidate revision 2: 10%" in r.stdout
    sessions = [f"user-{i}" for i in range(600)]
    responses = send_many(rig["url"], sessions, headers(rig))
    assert [(x.status_code, x.text[:200]) for x in responses if x.status_code != 200] == []
    chosen = {s: x.headers["x-llmdeploy-revision"] for s, x in zip(sessions, responses, strict=True)}
    rig["chosen"] = chosen
    # each session where its hash puts it (the split's own tests cover the hash's spread on many more)
    assert chosen == {s: "2" if sticky_bucket(s) < 10 else "1" for s in sessions}
    share = sum(v == "2" for v in chosen.values()) / len(chosen)
    assert 0.075 <= share <= 0.125, share
    again = sessions[::10]  # the same sessions later land where they landed before
    repeat = send_many(rig["url"], again + again, headers(rig))
    assert [x.headers["x-llmdeploy-revision"] for x in repeat] == [chosen[s] for s in again + again]


def test_pin_header_picks_a_revision(rig):
    for rev in ("1", "2"):
        pinned = send_many(
            rig["url"], [f"p{i}" for i in range(20)], {**headers(rig), "x-llmdeploy-revision": rev}
        )
        assert {x.headers["x-llmdeploy-revision"] for x in pinned} == {rev}
    unknown = httpx.post(
        f"{rig['url']}/v1/completions",
        json={"model": ALIAS, "prompt": "hi", "max_tokens": 1},
        headers={**headers(rig), "x-llmdeploy-revision": "99"},
    )
    assert 400 <= unknown.status_code < 500 and "error" in unknown.json()


def test_reapplying_a_new_canary_percent_moves_the_running_candidate(rig):
    """Issue 12: hot reload used to ignore rollout.canary_percent while a candidate was running."""
    r = rig["cli"].ok("apply", str(rig["files"]["v2c30"]))
    assert "candidate revision 2 now takes 30% of traffic" in r.stdout
    assert split_of(rig["cli"].status(NAME)) == {1: 70.0, 2: 30.0}
    r = rig["cli"].ok("apply", str(rig["files"]["v2"]))  # back to the file's 0%
    assert "candidate revision 2 now takes 0% of traffic" in r.stdout
    assert split_of(rig["cli"].status(NAME)) == {1: 100.0, 2: 0.0}
    rig["cli"].ok("canary", "--percent", "10")  # by hand, as before: the next steps start from there
    assert split_of(rig["cli"].status(NAME)) == {1: 90.0, 2: 10.0}


def test_plan_shows_the_diff_and_the_running_engines_throughput_ceiling(rig):
    r = rig["cli"].ok("plan", str(rig["files"]["v2c30"]), "--prompt-len", "64", "--output-len", "32")
    assert "rollout.canary_percent" in r.stdout and "concurrent sequences of 64 + 32 tokens" in r.stdout
    assert "Measured throughput ceiling" in r.stdout
    assert re.search(r"rev 1 \S+ .* ms/token", r.stdout) and re.search(r"rev 2 \S+", r.stdout)


def test_kill_9_of_the_daemon_mid_canary_then_apply_recovers_the_same_state(rig):
    before = rig["cli"].status(NAME)
    os.kill(before["daemon"]["pid"], signal.SIGKILL)
    wait_for(lambda: not port_open(rig["port"]), 60, what="router port to close")
    offline = rig["cli"].status(NAME)
    assert not offline["daemon"]["running"] and split_of(offline) == {1: 90.0, 2: 10.0}
    r = rig["cli"].ok("apply", str(rig["files"]["v2"]))
    assert "resumed from state.db" in r.stdout
    after = rig["cli"].status(NAME)
    assert split_of(after) == split_of(before) == {1: 90.0, 2: 10.0}
    assert [(x["id"], x["state"]) for x in after["revisions"]] == [
        (x["id"], x["state"]) for x in before["revisions"]
    ]
    for rev in (1, 2):  # re-adopted, not restarted
        assert pids_of(after, rev) == pids_of(before, rev)
    assert sum(e["kind"] == "engine-adopted" for e in after["events"]) == 2
    sessions = list(rig["chosen"])[:300]  # the split is the same one: sessions stay where they were
    again = send_many(rig["url"], sessions, headers(rig))
    assert [x.headers["x-llmdeploy-revision"] for x in again] == [rig["chosen"][s] for s in sessions]


def test_rollback_during_canary_returns_all_traffic_and_stops_the_candidate(rig):
    candidate_pids = pids_of(rig["cli"].status(NAME), 2)
    follower = subprocess.Popen(
        [LLMDEPLOY, "logs", "--follow"],
        env=rig["cli"].env,
        text=True,
        stdout=subprocess.PIPE,
        preexec_fn=ctrl_c_works,
    )
    time.sleep(1.0)
    r = rig["cli"].ok("rollback")
    time.sleep(1.0)
    follower.send_signal(signal.SIGINT)
    followed, _ = follower.communicate(timeout=10)
    assert follower.returncode == 0 and "[rollback] rev 2 candidate 2 rolled back" in followed
    assert "candidate revision 2 stopped" in r.stdout
    st = rig["cli"].status(NAME)
    assert split_of(st) == {1: 100.0}
    assert revision(st, 2)["state"] == "rolled-back" and pids_of(st, 2) == []
    assert candidate_pids and not any(pid_alive(p) for p in candidate_pids)
    served = {
        x.headers["x-llmdeploy-revision"]
        for x in send_many(rig["url"], [f"s{i}" for i in range(100)], headers(rig))
    }
    assert served == {"1"}
    assert any(e["kind"] == "rollback" and e["revision"] == 2 for e in st["events"])


def test_applying_the_rolled_back_file_needs_force(rig):
    r = rig["cli"].run("apply", str(rig["files"]["v2"]))
    assert r.returncode == 1 and "roll forward again" in r.stderr and "--force" in r.stderr
    assert [x["id"] for x in rig["cli"].status(NAME)["revisions"]] == [1, 2]
    r = rig["cli"].ok("apply", str(rig["files"]["v2"]), "--force")
    assert "revision 3 r1: ready" in r.stdout


def test_canary_100_promotes_and_stops_the_old_stable(rig):
    old_pids = pids_of(rig["cli"].status(NAME), 1)
    r = rig["cli"].ok("canary", "--percent", "100")
    assert "revision 3 promoted" in r.stdout
    st = rig["cli"].status(NAME)
    assert split_of(st) == {3: 100.0} and revision(st, 1)["state"] == "retired"
    wait_for(lambda: not any(pid_alive(p) for p in old_pids), 120, what="old stable engines to exit")
    r = rig["cli"].run("promote")
    assert r.returncode == 1 and "no candidate revision" in r.stderr


def test_rollback_without_canary_redeploys_the_previous_revision(rig):
    r = rig["cli"].ok("rollback")
    assert "rolling back to revision 1 as new revision 4" in r.stdout and "revision 4 serves 100%" in r.stdout
    st = rig["cli"].status(NAME)
    assert split_of(st) == {4: 100.0}
    four = revision(st, 4)
    assert four["origin"] == "rollback to 1" and four["spec_hash"] == revision(st, 1)["spec_hash"]
    assert revision(st, 3)["state"] == "rolled-back"
    history = json.loads(rig["cli"].ok("history", "--json").stdout)
    assert [(h["id"], h["origin"]) for h in history] == [
        (1, "apply"),
        (2, "apply"),
        (3, "apply"),
        (4, "rollback to 1"),
    ]
    assert (
        history[1]["change"] == "engine.max_num_seqs: 16 -> 8"
        and history[3]["change"] == "engine.max_num_seqs: 8 -> 16"
    )
    assert "rollback to 1" in rig["cli"].ok("history").stdout
    assert rig["cli"].ok("apply", str(rig["files"]["v1b"])).stdout.strip() == f"{NAME}: unchanged"


def test_rollback_to_a_revision_that_never_served_is_refused(rig):
    r = rig["cli"].run("rollback", "--to-revision", "2")
    assert r.returncode == 1 and "revision 2 never served (rolled-back)" in r.stderr
    r = rig["cli"].run("rollback", "--to-revision", "99")
    assert r.returncode == 2 and "there is no revision 99" in r.stderr
    r = rig["cli"].run("rollback", "--to-revision", "4")
    assert r.returncode == 1 and "already the stable revision" in r.stderr


def test_listen_change_moves_the_router_and_keeps_the_engines(rig, tmp_path):
    before = rig["cli"].status(NAME)
    spec = yaml.safe_load(rig["files"]["v1b"].read_text())
    new_port = free_port()
    spec["listen"] = f"127.0.0.1:{new_port}"
    rig["files"]["v1c"] = write_spec(tmp_path / "v1c.yaml", spec)
    r = rig["cli"].ok("apply", str(rig["files"]["v1c"]))
    assert "router re-listen" in r.stdout
    assert not port_open(rig["port"])
    rig["port"], rig["url"] = new_port, f"http://127.0.0.1:{new_port}"
    assert send_many(rig["url"], ["x"], headers(rig))[0].status_code == 200
    after = rig["cli"].status(NAME)
    assert pids_of(after, 4) == pids_of(before, 4) and after["url"] == rig["url"]


def test_down_closes_ports_keeps_state_and_apply_brings_the_revision_back(rig):
    st = rig["cli"].status(NAME)
    engine_ports = [int(x["url"].rsplit(":", 1)[1]) for x in st["replicas"]]
    r = rig["cli"].ok("down")
    assert "state kept" in r.stdout
    assert not port_open(rig["port"]) and not any(port_open(p) for p in engine_ports)
    assert not (rig["cli"].home / NAME / "admin.sock").exists()
    offline = rig["cli"].status(NAME)
    assert [(x["id"], x["state"]) for x in offline["revisions"]] == [
        (x["id"], x["state"]) for x in st["revisions"]
    ]
    rig["cli"].ok("apply", str(rig["files"]["v1c"]))
    back = rig["cli"].status(NAME)
    assert split_of(back) == {4: 100.0} and [x["revision"] for x in back["replicas"]] == [4]
    client = OpenAI(
        base_url=f"{rig['url']}/v1", api_key=rig["key"], max_retries=0
    )  # the generated key still works
    assert client.completions.create(model=ALIAS, prompt="hi", max_tokens=1).choices
