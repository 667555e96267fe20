"""deploy/grafana/llmdeploy.json and deploy/prometheus/alerts.yml: they parse, their thresholds fire where they
should (promtool's rule tests, where promtool is installed), and every metric name they use is exported by a
real running deployment (the router's /metrics and an engine's)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from tests.observability.conftest import HEADERS, NAME, PRICES, traffic

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "deploy" / "grafana" / "llmdeploy.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = REPO / "deploy" / "prometheus" / "alerts_test.yml"
METRIC = re.compile(r"\bllmdeploy(?:_router_[a-z0-9_]+|:[a-z0-9_]+)")
PROMTOOL = shutil.which("promtool")


def grafana_exprs() -> list[str]:
    dash = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    return exprs


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def used_metrics() -> set[str]:
    return {m for e in grafana_exprs() + [r["expr"] for r in alert_rules()] for m in METRIC.findall(e)}


def exported(text: str) -> set[str]:
    """Every name a scrape shows: its samples, and for a family declared without samples yet (a labelled metric
    nothing has touched, a CUDA-only gauge on CPU) the names its samples will have."""
    names = {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")
    }
    suffixes = {"counter": ("_total", ""), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, flags=re.M):
        base, kind = m.group(1).removesuffix("_total"), m.group(2)
        names |= {base + s for s in suffixes.get(kind, ("",))}
    return names


def test_alert_rules_have_the_schema_prometheus_reads():
    doc = yaml.safe_load(ALERTS.read_text())
    assert set(doc) == {"groups"} and doc["groups"]
    for group in doc["groups"]:
        assert isinstance(group["name"], str) and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, rule
            assert re.fullmatch(r"LLMDeploy[A-Za-z]+", rule["alert"]) and rule["expr"].strip()
            assert rule["labels"]["severity"] in ("info", "warning", "critical")
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
            if "for" in rule:
                assert re.fullmatch(r"\d+[smh]", rule["for"])
    names = {r["alert"] for r in alert_rules()}
    for topic in ("Queue", "KVCache", "Memory", "CloudShare", "ErrorRate", "BreakerOpen"):
        assert any(topic in n for n in names), f"no alert on {topic}"


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus)")
def test_promtool_checks_the_rules_and_their_thresholds(tmp_path):
    r = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(
        [PROMTOOL, "test", "rules", ALERT_TESTS.name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ALERT_TESTS.parent,
    )
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    # every Grafana query is valid PromQL: checked as recording rules ($__rate_interval is Grafana's)
    rules = [
        {"record": f"grafana:q{i}", "expr": e.replace("$__rate_interval", "5m")}
        for i, e in enumerate(grafana_exprs())
    ]
    path = tmp_path / "grafana_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "grafana", "rules": rules}]}))
    r = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_grafana_dashboard_is_importable_json():
    dash = json.loads(GRAFANA.read_text())
    assert dash["uid"] == "llmdeploy" and dash["schemaVersion"] >= 36
    assert dash["templating"]["list"][0]["type"] == "datasource"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in (
        "waiting",
        "kv cache",
        "ttft",
        "tpot",
        "cloud share",
        "by reason",
        "canary split",
        "rollbacks",
        "restarts",
    ):
        assert topic in titles, topic
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])


def test_every_metric_the_dashboard_and_alerts_use_is_exported(obs):
    traffic(obs)  # both backends, streams of several tokens: histograms and token counters get samples
    router = httpx.get(f"{obs['url']}/metrics", headers=HEADERS, timeout=30)
    assert router.status_code == 200
    st = obs["cli"].status(NAME)
    engine_url = st["replicas"][0]["url"]
    engine = httpx.get(f"{engine_url}/metrics", timeout=30)
    assert engine.status_code == 200
    names = exported(router.text) | exported(engine.text)
    missing = sorted(used_metrics() - names)
    assert missing == [], f"used by deploy/ but not exported: {missing}"
    # and the figures are real: engine memory and both backends' tokens have samples
    assert re.search(
        r'^llmdeploy_router_engine_rss_bytes\{replica="r1",revision="1"\} [1-9]', router.text, re.M
    )
    assert re.search(r"^llmdeploy:process_resident_memory_bytes\{.*\} [1-9]", engine.text, re.M)
    for backend in ("local", "cloud"):
        assert re.search(
            rf'^llmdeploy_router_tokens_total\{{backend="{backend}",direction="out"\}} [1-9]',
            router.text,
            re.M,
        ), backend
    assert re.search(
        r'^llmdeploy_router_traffic_percent\{revision="1",role="stable"\} 100', router.text, re.M
    )


def _sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_tokens_per_key_and_the_cloud_cost_count_what_was_served(obs):
    before = httpx.get(f"{obs['url']}/metrics", headers=HEADERS).text
    responses = traffic(obs, n=12)
    after = httpx.get(f"{obs['url']}/metrics", headers=HEADERS).text
    delta = {
        (b, d): _sample(after, "llmdeploy_router_tokens_total", backend=b, direction=d)
        - _sample(before, "llmdeploy_router_tokens_total", backend=b, direction=d)
        for b in ("local", "cloud")
        for d in ("in", "out")
    }
    served = {r.headers["x-llmdeploy-backend"] for r in responses}
    assert served == {"local", "cloud"}, [
        x for x in after.splitlines() if "overflow_total" in x or "capab" in x
    ]
    assert all(v > 0 for v in delta.values()), delta
    key_out = _sample(after, "llmdeploy_router_key_tokens_total", key="ops", direction="out") - _sample(
        before, "llmdeploy_router_key_tokens_total", key="ops", direction="out"
    )
    assert key_out == delta[("local", "out")] + delta[("cloud", "out")]
    spent = _sample(after, "llmdeploy_router_cloud_cost_total", currency="USD") - _sample(
        before, "llmdeploy_router_cloud_cost_total", currency="USD"
    )
    expected = (
        delta[("cloud", "in")] * PRICES["cloud_input_per_1m"]
        + delta[("cloud", "out")] * PRICES["cloud_output_per_1m"]
    ) / 1e6
    assert spent == pytest.approx(expected, rel=1e-6)
