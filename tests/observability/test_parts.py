"""The observability parts on their own: the time series, the cost arithmetic, the resource reading, saved bench
results, the status cells, and /dashboard's routes and auth on a router in this process."""

from __future__ import annotations

import re
from importlib.resources import files

import pytest
from starlette.testclient import TestClient

from llmdeploy.cli.observe_views import bench_line, cost_line, memory_cell
from llmdeploy.control.bench_results import KEEP, latest_curve, save_report
from llmdeploy.control.paths import DeploymentPaths
from llmdeploy.engine.resources import ResourceMeter, rss_bytes
from llmdeploy.policies.cost import Prices, Tokens, bench_cost, cloud_cost, cost_report, local_per_1m
from llmdeploy.policies.resources import ResourceUsage
from llmdeploy.router.app import create_router
from llmdeploy.router.table import RoutingTable
from llmdeploy.router.timeseries import FINE_S, TrafficSeries, percentile
from llmdeploy.spec.models import DeploymentSpec

T0 = 1_800_000_000.0  # a multiple of 60: bucket boundaries are easy to reason about


def test_series_buckets_tokens_errors_and_ttft_per_revision():
    s = TrafficSeries()
    for i in range(100):
        s.record(
            T0 + i * 0.1, "local", 1, error=(i % 10 == 0), ttft_ms=float(i + 1), tokens_in=3, tokens_out=2
        )
    s.record(T0 + 5, "cloud", None, error=False, ttft_ms=50.0, tokens_in=10, tokens_out=20)
    s.record(T0 + 5, "local", 2, error=True, ttft_ms=None, tokens_in=1, tokens_out=0)
    now = T0 + 15
    one = s.revision_stats(now, 60, 1)
    assert one["requests"] == 100 and one["errors"] == 10 and one["error_rate"] == pytest.approx(0.1)
    assert one["ttft_p50_ms"] == 50 and one["ttft_p99_ms"] == 99
    two = s.revision_stats(now, 60, 2)
    assert two["requests"] == 1 and two["error_rate"] == 1.0 and two["ttft_p99_ms"] is None
    assert s.tokens(now, 3600, "local") == Tokens(301, 200) and s.tokens(now, 3600, "cloud") == Tokens(10, 20)
    assert s.tokens(now, 86400, "cloud") == Tokens(10, 20)  # the day's ring holds the same
    share = s.share(now, 3600)
    assert share["requests"] == {"local": 101, "cloud": 1} and share["cloud_share"] == pytest.approx(1 / 102)
    points = s.points(now, 60)
    assert [p["t"] for p in points] == [T0 - 40 + FINE_S * k for k in range(6)]  # empty buckets included
    first = next(p for p in points if p["t"] == T0)
    assert first["local_requests"] == 101 and first["cloud_tokens"] == 30 and first["ttft_p99_ms"]["1"] == 99


def test_series_forgets_what_is_older_than_its_rings():
    s = TrafficSeries()
    s.record(T0, "cloud", None, False, None, 100, 100)
    later = T0 + 2 * 3600
    s.record(later, "cloud", None, False, None, 1, 1)
    assert s.tokens(later, 3600, "cloud") == Tokens(1, 1)
    assert s.tokens(later, 86400, "cloud") == Tokens(101, 101)
    s.record(T0 + 2 * 86400, "cloud", None, False, None, 0, 0)
    assert s.tokens(T0 + 2 * 86400, 86400, "cloud") == Tokens(0, 0)
    assert len(s.fine.buckets) <= s.fine.keep and len(s.coarse.buckets) <= s.coarse.keep


def test_percentile_is_nearest_rank():
    assert percentile([], 0.5) is None
    assert percentile([5.0], 0.99) == 5.0
    assert percentile([float(v) for v in range(1, 101)], 0.99) == 99.0


def test_cost_arithmetic():
    p = Prices(cloud_input_per_1m=0.5, cloud_output_per_1m=1.5, local_per_hour=2.0, currency="EUR")
    assert cloud_cost(p, Tokens(2_000_000, 1_000_000)) == pytest.approx(2.5)
    assert cloud_cost(Prices(local_per_hour=1.0), Tokens(5, 5)) is None
    # the machine's hour spread over the tokens it served in that hour
    assert local_per_1m(p, Tokens(500_000, 500_000), 3600) == pytest.approx(2.0)
    assert local_per_1m(p, Tokens(500_000, 500_000), 1800) == pytest.approx(1.0)
    assert local_per_1m(p, Tokens(), 3600) is None
    r = cost_report(p, Tokens(1_000_000, 0), Tokens(1_000_000, 1_000_000), Tokens(3_000_000, 1_000_000), 3600)
    assert r.cloud_per_1m == pytest.approx(1.0) and r.spill_last_hour == pytest.approx(2.0)
    assert r.spill_last_day == pytest.approx(3.0) and r.local_per_1m == pytest.approx(2.0)
    assert r.currency == "EUR" and r.local_tokens_last_hour == 1_000_000
    b = bench_cost(p, output_tokens_per_s=100.0, mean_prompt_tokens=300.0, mean_output_tokens=100.0)
    assert b.local_per_1m_output == pytest.approx(2.0 / 0.36)  # 360k output tokens per hour
    assert b.cloud_per_1m_output == pytest.approx(1.5 + 3 * 0.5)  # each output token brings 3 prompt tokens
    assert "EUR per 1M output tokens locally" in b.line()
    assert bench_cost(Prices(), 100.0, 1.0, 1.0) is None


def test_cost_section_is_optional_and_validated():
    assert (
        DeploymentSpec().cost.local_per_hour is None
        and not Prices.from_spec(DeploymentSpec().cost).configured
    )
    spec = DeploymentSpec.model_validate({"cost": {"cloud_input_per_1m": 0.8, "local_per_hour": 1.5}})
    assert Prices.from_spec(spec.cost) == Prices(0.8, None, 1.5, "USD")
    with pytest.raises(ValueError, match="cloud_output_per_1m"):
        DeploymentSpec.model_validate({"cost": {"cloud_output_per_1m": -1}})
    with pytest.raises(ValueError, match="extra"):
        DeploymentSpec.model_validate({"cost": {"cloud_price": 1}})


def test_resources_of_this_process():
    rss, peak = rss_bytes()
    assert 0 < rss <= peak
    usage = ResourceMeter().measure()
    assert usage.device == "cpu" and usage.rss_bytes > 0 and usage.host_memory_total_bytes > usage.rss_bytes
    assert usage.device_memory_bytes is None and usage.gpu_utilization is None
    assert ResourceUsage.from_json(usage.to_json()) == usage
    assert ResourceUsage.from_json(None) is None and ResourceUsage.from_json({"rss_bytes": "lots"}) is None


def test_saved_bench_results_newest_first_and_bounded(tmp_path):
    paths = DeploymentPaths("d", tmp_path / "d").create()
    assert latest_curve(paths) is None
    level = {
        "mode": "concurrency",
        "value": 4,
        "requests_per_s": 2.0,
        "output_tokens_per_s": 50.0,
        "ttft_ms": {"p50": 10, "p99": 30},
        "tpot_ms": {"p99": 5},
        "success_rate": 1.0,
        "meets_sla": True,
    }
    for i in range(KEEP + 3):
        save_report(paths, {"started_at": f"run {i}", "levels": [level], "sla": {"ttft_p99_ms": 100}})
    saved = sorted((paths.root / "bench").glob("*.json"))
    assert len(saved) == KEEP
    curve = latest_curve(paths)
    assert curve["started_at"] == f"run {KEEP + 2}" and curve["levels"][0]["ttft_p99_ms"] == 30
    assert curve["mode"] == "concurrency" and curve["sla"]["ttft_p99_ms"] == 100
    saved[-1].write_text("{not json")
    assert latest_curve(paths) is None


def test_status_cells():
    assert memory_cell(None) == "-"
    cpu = {"rss_bytes": 512 * 2**20, "peak_rss_bytes": 3 * 2**30, "device": "cpu"}
    assert memory_cell(cpu) == "RSS 512 MiB (peak 3.0 GiB)"
    gpu = {
        **cpu,
        "device": "cuda",
        "device_memory_bytes": 2**31,
        "device_peak_memory_bytes": 2**32,
        "device_memory_total_bytes": 80 * 2**30,
        "gpu_utilization": 0.45,
    }
    assert memory_cell(gpu).endswith("| GPU 2.0 GiB of 80.0 GiB (peak 4.0 GiB), util 45%")
    line = cost_line(
        {
            "currency": "USD",
            "local_per_1m": 0.25,
            "cloud_per_1m": 1.0,
            "spill_last_hour": 0.5,
            "spill_last_day": None,
        }
    )
    assert line == (
        "per 1M tokens: local 0.25 USD, cloud 1 USD; spill to the cloud: 0.5 USD last hour, - last day"
    )
    assert cost_line(None) is None and bench_line({"levels": []}) is None
    assert "4: 50 tok/s, TTFT p99 30 ms" in bench_line(
        {
            "file": "x.json",
            "mode": "concurrency",
            "levels": [{"value": 4, "output_tokens_per_s": 50, "ttft_p99_ms": 30}],
        }
    )


def make_router(**spec):
    return create_router(DeploymentSpec.model_validate(spec), RoutingTable(), environ={"DASH_KEY": "sk-dash"})


def router_client(**spec) -> TestClient:
    return TestClient(make_router(**spec).app)


def test_dashboard_routes_and_auth():
    spec = {"auth": {"api_key_required": True, "keys": [{"name": "ops", "key_env": "DASH_KEY"}]}}
    with router_client(**spec) as c:
        page = c.get("/dashboard")
        assert page.status_code == 200 and '<meta name="llmdeploy-auth" content="required">' in page.text
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe" not in csp
        assert c.get("/dashboard/static/app.js").headers["content-type"].startswith("text/javascript")
        missing = c.get("/dashboard/static/../app.py")
        assert missing.status_code == 404
        assert c.get("/dashboard/static/nope.js").json()["error"]["code"] == "not_found"
        denied = c.get("/dashboard/api/state")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/dashboard/api/state", headers={"authorization": "Bearer wrong"}).status_code == 401
        ok = c.get("/dashboard/api/state", headers={"authorization": "Bearer sk-dash"})
        assert ok.status_code == 200 and ok.headers["cache-control"] == "no-store"
        doc = ok.json()
        assert (
            doc["daemon"] is False and doc["events"] == [] and doc["revisions"] == [] and doc["cost"] is None
        )
        assert len(doc["traffic"]["points"]) >= 90 and "sk-dash" not in ok.text


def test_dashboard_without_auth_merges_the_control_feed_and_counts_events():
    router = make_router(auth={"api_key_required": False}, cost={"local_per_hour": 1.0})
    calls = []

    async def feed() -> dict:
        calls.append(1)
        return {
            "name": "chat",
            "events": [
                {"id": i, "ts": T0, "kind": "apply", "revision": 1, "message": "m", "data": {}}
                for i in range(20)
            ],
            "bench": {"levels": [{"value": 1}]},
        }

    router.set_control_feed(feed)
    router.control_event("auto-rollback", 2)
    router.control_event("engine-crash", 1)
    with TestClient(router.app) as c:
        assert 'content="none"' in c.get("/dashboard").text
        doc = c.get("/dashboard/api/state").json()
        again = c.get("/dashboard/api/state").json()
        metrics = c.get("/metrics").text
    assert doc["deployment"] == "chat" and doc["daemon"] is True and len(doc["events"]) == 12
    assert doc["bench"] == {"levels": [{"value": 1}]} and again["deployment"] == "chat"
    assert len(calls) == 1  # the feed is cached for a second: many open pages, one status document
    assert doc["cost"]["local_per_1m"] is None and doc["cost"]["currency"] == "USD"
    assert 'llmdeploy_router_rollbacks_total{trigger="auto"} 1.0' in metrics
    assert 'llmdeploy_router_engine_restarts_total{revision="1"} 1.0' in metrics
    assert 'llmdeploy_router_control_events_total{kind="auto-rollback"} 1.0' in metrics


def test_static_assets_load_nothing_from_elsewhere():
    static = files("llmdeploy.router") / "static"
    names = sorted(p.name for p in static.iterdir())
    assert names == ["app.js", "index.html", "style.css"]
    for name in names:
        text = (static / name).read_text()
        urls = re.findall(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text)
        # the SVG namespace is a name, not a fetch
        assert urls == [] or urls == ["http://www.w3.org"], (name, urls)
        assert "@import" not in text and "innerHTML" not in text and "eval(" not in text
