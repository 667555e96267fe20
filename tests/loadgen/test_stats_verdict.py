"""Percentiles, a level's figures, the SLA verdict and --compare, on synthetic results."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from llmdeploy.loadgen.compare import compare_levels, judge_figure
from llmdeploy.loadgen.results import LoadPoint
from llmdeploy.loadgen.stats import percentile, summarize
from llmdeploy.loadgen.verdict import SLA, judge
from tests.loadgen.synthetic import err, level, ok


def test_percentile_interpolates_like_numpy():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 100.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None
    assert percentile([4.0], 99) == 4.0
    assert percentile([1.0, float("inf"), float("inf")], 99) == float("inf")  # inf - inf must not give nan


def test_level_figures_from_results():
    rs = [
        ok(0.0, ttft=0.1, e2e=1.0, tokens=11, backend="local"),
        ok(0.5, ttft=0.3, e2e=2.0, tokens=11, backend="cloud"),
        ok(1.0, ttft=0.2, e2e=1.0, tokens=1, backend="local"),
        err(1.5, 429, "http_429:rate_limit_exceeded"),
        err(1.6, None, "timeout"),
    ]
    s = summarize(LoadPoint("concurrency", 4), rs)
    assert (s.requests, s.ok, s.success_rate) == (5, 3, pytest.approx(0.6))
    assert s.errors == {"http_429:rate_limit_exceeded": 1, "timeout": 1}
    assert s.elapsed_s == pytest.approx(2.5)  # the level lasts until its last answer
    assert s.output_tokens == 23 and s.requests_per_s == pytest.approx(3 / 2.5)
    assert s.output_tokens_per_s == pytest.approx(23 / 2.5)
    assert s.ttft_ms.p50 == pytest.approx(200) and s.ttft_ms.max == pytest.approx(300)
    # TPOT = (e2e - ttft) / (tokens - 1); a one-token answer has none
    assert s.tpot_ms.count == 2 and s.tpot_ms.max == pytest.approx(1700 / 10)
    assert s.backends == {"cloud": 1, "local": 2} and s.share == {
        "cloud": pytest.approx(1 / 3),
        "local": pytest.approx(2 / 3),
    }
    assert s.by_kind == {} and s.arrival_rate is None
    json.dumps(asdict(s))  # every figure is plain JSON


def test_long_and_short_prompts_are_reported_apart():
    rs = [ok(0, 2.0, kind="long"), ok(0.1, 0.05, kind="short"), ok(0.2, 0.06, kind="short")]
    s = summarize(LoadPoint("rate", 2), rs)
    assert s.by_kind["long"]["ttft_p99_ms"] == pytest.approx(2000)
    assert s.by_kind["short"]["requests"] == 2 and s.by_kind["short"]["ttft_p50_ms"] == pytest.approx(55)
    assert s.arrival_rate == pytest.approx(3 / 0.2)


def test_empty_level():
    s = summarize(LoadPoint("rate", 1), [])
    assert s.success_rate is None and s.ttft_ms.p99 is None and s.requests_per_s == 0


def test_verdict_is_the_highest_load_that_meets_the_sla():
    levels = [level(1, 0.1), level(4, 0.3), level(16, 0.9), level(32, 2.5)]
    v = judge(levels, SLA(ttft_p99_ms=1000, tpot_p99_ms=200))
    assert [lv.meets_sla for lv in levels] == [True, True, True, False]
    assert v.highest_passing == LoadPoint("concurrency", 16) and v.asked == LoadPoint("concurrency", 32)
    assert not v.asked_meets_sla
    assert levels[3].sla_misses == ["TTFT p99 2500 ms > 1000 ms"]
    assert "highest that meets it: concurrency 16" in v.summary


def test_verdict_counts_failures_and_tpot():
    failing = level(8, 0.1, n=100, failures=2)  # 98% < 99%
    slow_tokens = level(4, 0.1, tpot_s=0.3)
    v = judge([slow_tokens, failing], SLA(ttft_p99_ms=1000, tpot_p99_ms=200))
    assert failing.sla_misses == ["success 98.0% < 99.0%"]
    assert slow_tokens.sla_misses == ["TPOT p99 300 ms > 200 ms"]
    assert v.highest_passing is None and "no level meets" in v.summary
    loose = level(8, 0.1, n=100, failures=2)
    assert judge([loose], SLA(ttft_p99_ms=1000, min_success_rate=0.95)).asked_meets_sla


def test_without_latency_targets_only_success_counts():
    v = judge([level(1, 50.0)], SLA())
    assert v.asked_meets_sla and "no latency target" in v.summary
    assert judge([level(1, 0.1, n=10, failures=10)], SLA()).summary.startswith("no level meets")


def test_a_level_without_answers_misses():
    lv = summarize(LoadPoint("rate", 3), [])
    assert not judge([lv], SLA(ttft_p99_ms=1000)).asked_meets_sla
    assert lv.sla_misses == ["no request finished in the level"]


def _as_json(*levels):
    return [json.loads(json.dumps(asdict(lv))) for lv in levels]


def test_compare_flags_figures_that_moved_the_wrong_way_beyond_tolerance():
    base = _as_json(level(1, 0.100), level(4, 0.200))
    now = _as_json(level(1, 0.105), level(4, 0.300))  # +5% within 10%; +50% beyond
    c = compare_levels(base, now, tolerance=0.10)
    bad = {(ch.level, ch.figure) for ch in c.regressions}
    assert ("concurrency 4", "TTFT p99 ms") in bad and ("concurrency 4", "TTFT p50 ms") in bad
    assert not any(level == "concurrency 1" for level, _ in bad)
    assert c.only_in_baseline == [] and c.only_in_current == []
    # better figures are never regressions
    c2 = compare_levels(now, base, tolerance=0.10)
    assert not c2.regressions and {ch.direction for ch in c2.changes if "TTFT" in ch.figure} <= {
        "better",
        "same",
    }
    json.dumps(c.to_dict())


def test_compare_directions_floor_and_success_points():
    assert judge_figure("requests_per_s", "higher", 10.0, 8.0, 0.10) == (pytest.approx(-0.2), "worse", True)
    assert judge_figure("requests_per_s", "higher", 10.0, 12.0, 0.10)[1:] == ("better", False)
    assert judge_figure("ttft_ms.p50", "lower", 2.0, 2.9, 0.10)[2] is False  # +45% but under 1 ms: noise
    assert judge_figure("ttft_ms.p50", "lower", 20.0, 29.0, 0.10)[2] is True
    assert judge_figure("success_rate", "higher", 1.0, 0.995, 0.10)[2] is False
    assert judge_figure("success_rate", "higher", 1.0, 0.97, 0.50) == (pytest.approx(-0.03), "worse", True)
    assert judge_figure("requests_per_s", "higher", 0.0, 0.0, 0.1) == (0.0, "same", False)
    assert judge_figure("requests_per_s", "higher", None, 3.0, 0.1) == (None, "n/a", False)


def test_compare_reports_levels_run_only_once():
    c = compare_levels(_as_json(level(1, 0.1), level(8, 0.1)), _as_json(level(1, 0.1), level(2, 0.1)), 0.1)
    assert c.only_in_baseline == ["concurrency 8"] and c.only_in_current == ["concurrency 2"]
    assert {ch.level for ch in c.changes} == {"concurrency 1"}
