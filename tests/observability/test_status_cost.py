"""`status` (one-shot, --json, --watch), the cost figures, the memory watermarks, `bench --save` and the counters
the control plane feeds, on the shared real deployment."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import httpx

from tests.control.conftest import LLMDEPLOY, wait_for
from tests.helpers.procs import ctrl_c_works
from tests.observability.conftest import HEADERS, NAME, PRICES, ensure_candidate, traffic


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=HEADERS, timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())
    )


def test_status_shows_cost_memory_and_ttft_p50(obs):
    traffic(obs)
    st = obs["cli"].status(NAME)
    cost = st["router"]["cost"]
    assert (
        cost["currency"] == "USD"
        and cost["cloud_tokens_last_hour"] > 0
        and cost["local_tokens_last_hour"] > 0
    )
    assert cost["spill_last_hour"] > 0 and cost["spill_last_day"] >= cost["spill_last_hour"]
    assert cost["local_per_1m"] > 0
    lo, hi = sorted((PRICES["cloud_input_per_1m"], PRICES["cloud_output_per_1m"]))
    assert lo <= cost["cloud_per_1m"] <= hi  # a blend of the two prices by the tokens' mix
    res = st["replicas"][0]["resources"]
    assert (
        res["device"] == "cpu" and res["rss_bytes"] > 10 * 2**20 and res["peak_rss_bytes"] >= res["rss_bytes"]
    )
    stable = next(r for r in st["router"]["revisions"] if r["role"] == "stable")
    assert stable["window"]["ttft_p50_ms"] is not None
    text = obs["cli"].ok("status", "--name", NAME, env={"COLUMNS": "220"}).stdout
    for shown in ("per 1M tokens: local", "spill to the cloud", "RSS", "(peak", "TTFT P50"):
        assert shown in text, (shown, text)


def test_status_watch_redraws_every_second_and_ctrl_c_exits_0(obs):
    r = obs["cli"].run("status", "--watch", "--json")
    assert r.returncode == 2 and "do not go together" in r.stderr
    proc = subprocess.Popen(
        [LLMDEPLOY, "status", "--watch", "--name", NAME],
        env={**obs["cli"].env, "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_works,
    )
    try:
        out = ""
        deadline = time.monotonic() + 60
        while out.count("refreshing every 1 s") < 3 and time.monotonic() < deadline:
            out += proc.stdout.readline()
        assert out.count("refreshing every 1 s") >= 3, out
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Revisions" in out and "traffic split" in out and "Last events" in out and "Traceback" not in err


def test_bench_prints_the_cost_and_saves_its_curve_for_status_and_the_dashboard(obs, tmp_path):
    out_json = tmp_path / "bench.json"
    r = obs["cli"].run(
        "bench",
        "--sla-from",
        str(obs["v1"]),
        "--concurrency",
        "1,2",
        "--requests",
        "4",
        "--output-len",
        "4",
        "--warmup",
        "0",
        "--save",
        "--json",
        str(out_json),
        env={"COLUMNS": "200"},
        timeout=400,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(
        r"cost at \d+ concurrency: [\d.,]+ USD per 1M output tokens locally at [\d.]+ output", r.stdout
    )
    assert "at the cloud's prices" in r.stdout
    report = json.loads(out_json.read_text())
    assert report["cost"]["currency"] == "USD" and report["cost"]["local_per_1m_output"] > 0
    saved = sorted((obs["cli"].home / NAME / "bench").glob("*.json"))
    assert len(saved) == 1 and f"saved {saved[0]}" in r.stderr.replace("\n", "")
    bench = obs["cli"].status(NAME)["bench"]
    assert [lv["value"] for lv in bench["levels"]] == [1, 2] and bench["cost"] == report["cost"]
    assert all(lv["output_tokens_per_s"] > 0 for lv in bench["levels"])
    # the dashboard's JSON: behind the key, with the same curve
    url = f"{obs['url']}/dashboard/api/state"
    denied = httpx.get(url)
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    doc = httpx.get(url, headers=HEADERS).json()
    assert doc["bench"]["levels"] == bench["levels"] and doc["deployment"] == NAME and doc["daemon"] is True
    assert doc["cost"]["currency"] == "USD" and doc["share_last_hour"]["requests"]["cloud"] > 0
    r = obs["cli"].run("bench", "--sla-from", str(obs["v1"]), "--save", "--name", "nope", "--requests", "1")
    assert r.returncode == 2 and "--save: no deployment named 'nope'" in r.stderr


def test_rollbacks_and_engine_restarts_are_counted(obs):
    url = obs["url"]
    manual = metric(url, "llmdeploy_router_rollbacks_total", trigger="manual")
    ensure_candidate(obs)
    obs["cli"].ok("rollback")
    assert metric(url, "llmdeploy_router_rollbacks_total", trigger="manual") == manual + 1
    assert metric(url, "llmdeploy_router_control_events_total", kind="rollback") >= 1
    assert metric(url, "llmdeploy_router_traffic_percent", revision="1", role="stable") == 100
    st = obs["cli"].status(NAME)
    (engine,) = [r for r in st["replicas"] if r["revision"] == st["stable"]]
    before = metric(url, "llmdeploy_router_engine_restarts_total", revision=str(st["stable"]))
    os.kill(engine["pid"], signal.SIGKILL)
    wait_for(
        lambda: (
            metric(url, "llmdeploy_router_engine_restarts_total", revision=str(st["stable"])) == before + 1
        ),
        60,
        what="the restart counter",
    )
    wait_for(lambda: obs["cli"].status(NAME)["replicas"][0]["ready"], 240, 1.0, what="the engine to be back")
