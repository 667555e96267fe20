"""`llmdeploy bench` end to end against real processes: the standalone router in front of a tiny-model engine and
the fake cloud, and the engine alone. Marked slow: a tiny engine on a busy 2-core box takes a minute or more to
start and answer; the runs are kept to a few requests of a few tokens."""

from __future__ import annotations

import copy
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmdeploy.cli.main import app
from tests.loadgen.conftest import ALIAS, BENCH_KEY, CLOUD_REPLY_TOKENS, ENV, TIGHT_KEY

pytestmark = pytest.mark.slow

OUT = 6  # tokens per local answer (--ignore-eos); the fake cloud answers CLOUD_REPLY_TOKENS (< OUT)
SMALL = ["--prompt-len", "16", "--output-len", str(OUT), "--ignore-eos", "--warmup", "0", "--timeout", "120s"]
LEVEL_FIELDS = {
    "mode",
    "value",
    "elapsed_s",
    "requests",
    "ok",
    "success_rate",
    "errors",
    "requests_per_s",
    "output_tokens_per_s",
    "output_tokens",
    "mean_prompt_tokens",
    "mean_output_tokens",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "backends",
    "share",
    "token_source",
    "by_kind",
    "arrival_rate",
    "server",
    "meets_sla",
    "sla_misses",
}
QUANTILES = {"p50", "p90", "p99", "mean", "max", "count"}
REPORT_FIELDS = {
    "tool",
    "format",
    "version",
    "started_at",
    "target",
    "load",
    "sla",
    "levels",
    "verdict",
    "burst",
    "compare",
    "metrics",
    "notes",
    "exit_code",
}


def bench(*args: str | Path):
    result = CliRunner().invoke(app, ["bench", *map(str, args)], env=ENV)
    assert BENCH_KEY not in result.output and TIGHT_KEY not in result.output
    return result


def report(path: Path) -> dict:
    text = path.read_text()
    assert BENCH_KEY not in text and TIGHT_KEY not in text
    return json.loads(text)


def test_router_run_has_every_field_a_png_and_meets_a_loose_sla(deployment, tmp_path):
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    r = bench(
        "--sla-from",
        deployment.spec_path,
        "--concurrency",
        "1,2",
        "--requests",
        "3",
        *SMALL,
        "--metrics-url",
        f"{deployment.router_url}/metrics",
        "--metrics-url",
        f"{deployment.engine_url}/metrics",
        "--json",
        out,
        "--chart",
        png,
    )
    assert r.exit_code == 0, r.output
    assert "verdict:" in r.output and "concurrency 2 meets the SLA" in r.output
    d = report(out)
    assert set(d) == REPORT_FIELDS and d["exit_code"] == 0
    assert d["target"] == {
        "url": deployment.router_url,
        "api_base": f"{deployment.router_url}/v1",
        "model": ALIAS,
        "api_key_env": "BENCH_KEY",
    }
    assert d["sla"]["ttft_p99_ms"] == 60000 and d["sla"]["source"] == str(deployment.spec_path)
    assert [lv["value"] for lv in d["levels"]] == [1, 2]
    for lv in d["levels"]:
        assert set(lv) == LEVEL_FIELDS
        assert set(lv["ttft_ms"]) == set(lv["tpot_ms"]) == set(lv["e2e_ms"]) == QUANTILES
        assert (lv["requests"], lv["ok"], lv["success_rate"], lv["errors"]) == (3, 3, 1.0, {})
        # each answer is booked to the backend that served it: the engine gives OUT tokens (ignore_eos), the cloud 5
        assert set(lv["backends"]) <= {"local", "cloud"} and sum(lv["backends"].values()) == 3
        local, cloud = lv["backends"].get("local", 0), lv["backends"].get("cloud", 0)
        assert lv["output_tokens"] == OUT * local + CLOUD_REPLY_TOKENS * cloud and lv["token_source"] == {
            "usage": 3
        }
        assert lv["ttft_ms"]["p99"] > 0 and lv["tpot_ms"]["count"] == 3 and lv["meets_sla"] is True
        assert lv["requests_per_s"] > 0
        assert lv["output_tokens_per_s"] == pytest.approx(lv["output_tokens"] / lv["elapsed_s"])
        assert sum(lv["share"].values()) == pytest.approx(1.0)
        server = lv["server"]
        assert (
            server["samples"] >= 1
            and server["kv_usage"] is not None
            and server["router_inflight"] is not None
        )
    assert d["metrics"]["absent"] == {} and len(d["metrics"]["sources"]) == 2
    assert d["verdict"]["asked_meets_sla"] and d["verdict"]["highest_passing"] == {
        "mode": "concurrency",
        "value": 2.0,
    }
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.external: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.external += [v for k, v in attrs if k in ("src", "href") and v and v.startswith(("http", "//"))]


def test_tight_sla_exits_1_and_draws_html(deployment, tmp_path):
    out, page = tmp_path / "tight.json", tmp_path / "tight.html"
    r = bench(
        "--sla-from",
        deployment.spec_path,
        "--ttft-p99-ms",
        "0.01",
        "-c",
        "1",
        "-n",
        "1",
        *SMALL,
        "--json",
        out,
        "--chart",
        page,
    )
    assert r.exit_code == 1, r.output
    d = report(out)
    assert (
        d["exit_code"] == 1
        and not d["verdict"]["asked_meets_sla"]
        and d["verdict"]["highest_passing"] is None
    )
    assert d["levels"][0]["sla_misses"][0].startswith("TTFT p99")
    # without --metrics-url the router's own /metrics (the key opens it) gives its requests in flight and the
    # engines' KV usage it re-exports (llmdeploy_router_engine_kv_cache_usage_perc)
    server = d["levels"][0]["server"]
    assert server["router_inflight"] is not None and server["kv_usage"] is not None
    parser = _Tags()
    parser.feed(page.read_text())
    assert {"html", "svg", "table"} <= parser.tags and "script" not in parser.tags and parser.external == []
    assert "SLA TTFT p99 0.01 ms" in page.read_text()


def test_compare_reruns_the_baseline_and_exits_1_on_a_regression(deployment, tmp_path):
    base = tmp_path / "base.json"
    r = bench("--sla-from", deployment.spec_path, "-c", "1", "-n", "2", *SMALL, "--json", base)
    assert r.exit_code == 0, r.output
    d = report(base)
    better = copy.deepcopy(d)  # a baseline far faster than anything this box does: now is a regression
    for lv in better["levels"]:
        lv["requests_per_s"] *= 1000
        lv["output_tokens_per_s"] *= 1000
    (tmp_path / "fast.json").write_text(json.dumps(better))
    out = tmp_path / "now.json"
    r = bench("--compare", tmp_path / "fast.json", "--json", out)
    assert r.exit_code == 1, r.output
    assert "REGRESSION" in r.output
    now = report(out)
    assert now["load"] == d["load"] and now["target"] == d["target"]  # the same load ran again
    assert {c["figure"] for c in now["compare"]["changes"] if c["regression"]} >= {
        "requests/s",
        "output tok/s",
    }
    worse = copy.deepcopy(d)  # a baseline far slower: every move is an improvement
    for lv in worse["levels"]:
        lv["requests_per_s"] /= 1000
        lv["output_tokens_per_s"] /= 1000
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            lv[key] = {q: (v * 1000 if isinstance(v, float) else v) for q, v in lv[key].items()}
    (tmp_path / "slow.json").write_text(json.dumps(worse))
    r = bench("--compare", tmp_path / "slow.json", "--tolerance", "10%")
    assert r.exit_code == 0, r.output
    assert "0 regressions beyond 10%" in r.output


def test_burst_splits_between_local_and_cloud(deployment, tmp_path):
    """local_rps 1 in the YAML: at 6x a 1/s rate the token bucket sends the excess to the fake cloud."""
    out = tmp_path / "burst.json"
    before = deployment.cloud.stats()["requests"]
    r = bench(
        "--sla-from",
        deployment.spec_path,
        "--rate",
        "1",
        "-n",
        "2",
        *SMALL,
        "--burst",
        "6x:2s:1s",
        "--json",
        out,
        "--chart",
        tmp_path / "burst.png",
    )
    assert r.exit_code == 0, r.output
    assert "Burst drill: 6x for 2 s" in r.output
    b = report(out)["burst"]
    assert (b["base_rate"], b["burst_rate"], b["factor"]) == (1.0, 6.0, 6.0)
    assert "highest rate level that met the SLA" in b["base_rate_reason"]
    assert sum(b["arrivals"].values()) == len(b["timeline"])
    for phase, outcomes in b["outcomes"].items():
        assert sum(outcomes.values()) == b["arrivals"][phase]
        assert outcomes["rejected"] == outcomes["failed"] == 0 and outcomes["local_late"] == 0
        assert outcomes["unknown_on_time"] == outcomes["unknown_late"] == 0  # the router names every backend
    assert b["outcomes"]["burst"]["cloud"] >= 1 and b["excess"] == pytest.approx(b["arrivals"]["burst"] - 2.0)
    assert b["recovered"] and b["recovery_s"] == 0.0  # a 60 s target is never missed
    cloud_served = sum(o["cloud"] for o in b["outcomes"].values())
    assert deployment.cloud.stats()["requests"] - before >= cloud_served


def test_burst_counts_429_rejections(deployment, tmp_path):
    """The `tight` key may send one request a minute: the preflight takes it, everything after is a 429."""
    out = tmp_path / "rejected.json"
    r = bench(
        "--sla-from",
        deployment.spec_path,
        "--api-key-env",
        "TIGHT_KEY",
        "--rate",
        "2",
        "-n",
        "2",
        *SMALL,
        "--warmup",
        "0",
        "--burst",
        "2x:1s:1s",
        "--json",
        out,
    )
    assert r.exit_code == 1, r.output
    d = report(out)
    assert list(d["levels"][0]["errors"]) == ["http_429:rate_limit_exceeded"] and d["levels"][0]["ok"] == 0
    b = d["burst"]
    assert "no level met the SLA" in b["base_rate_reason"] and b["base_rate"] == 2.0
    for phase in ("before", "burst", "after"):
        assert b["outcomes"][phase]["rejected"] == b["arrivals"][phase]
        assert b["rejected_by_status"][phase] == (
            {"429": b["arrivals"][phase]} if b["arrivals"][phase] else {}
        )
    assert b["recovery_s"] is None and not b["recovered"]


def test_engine_alone_with_a_mix(deployment, tmp_path):
    """No router: no x-llmdeploy-backend header ("unknown"); the engine's own /metrics has KV and queue."""
    out = tmp_path / "engine.json"
    r = bench(
        "--url",
        deployment.engine_url,
        "--model",
        ALIAS,
        "--rate",
        "4",
        "-n",
        "4",
        "--mix",
        "40:4",
        "--mix-ratio",
        "1:1",
        "--output-len",
        "2",
        "--warmup",
        "0",
        "--json",
        out,
    )
    assert r.exit_code == 0, r.output
    lv = report(out)["levels"][0]
    assert lv["backends"] == {"unknown": 4} and lv["server"]["kv_usage"] is not None
    assert lv["server"]["waiting"] is not None and lv["arrival_rate"] > 0
    assert set(lv["by_kind"]) == {"long", "short"}
    assert lv["by_kind"]["long"]["requests"] + lv["by_kind"]["short"]["requests"] == 4


def test_wrong_key_stops_at_the_preflight(deployment):
    r = CliRunner().invoke(
        app,
        [
            "bench",
            "--url",
            deployment.router_url,
            "--model",
            ALIAS,
            "--api-key-env",
            "WRONG",
            "-c",
            "1",
            "-n",
            "1",
        ],
        env={**ENV, "WRONG": "sk-not-a-key"},
    )
    assert r.exit_code == 1 and "http_401" in r.output and "--api-key-env" in r.output
