"""The burst drill's accounting and recovery time, and the Poisson arrival schedule, on synthetic results."""

from __future__ import annotations

import random

import pytest

from llmdeploy.loadgen.burst import (
    classify,
    count_outcomes,
    fallback_rate,
    recovery_time,
    sustainable_rate,
)
from llmdeploy.loadgen.schedule import Phase, burst_phases, level_arrivals, poisson_arrivals
from llmdeploy.loadgen.verdict import SLA, judge
from tests.loadgen.synthetic import err, level, ok


def test_each_request_lands_in_one_outcome():
    assert classify(ok(ttft=0.2, backend="local"), 500) == "local_on_time"
    assert classify(ok(ttft=0.8, backend="local"), 500) == "local_late"
    assert classify(ok(ttft=5.0, backend="cloud"), 500) == "cloud"
    assert classify(ok(ttft=0.8, backend="unknown"), 500) == "unknown_late"
    assert classify(err(status=429, error="http_429"), 500) == "rejected"
    assert classify(err(status=503), 500) == "rejected"
    assert classify(err(status=None, error="timeout"), 500) == "failed"
    assert classify(err(status=500, error="http_500"), 500) == "failed"
    rs = [
        ok(ttft=0.1),
        ok(ttft=0.9),
        ok(backend="cloud"),
        err(status=429),
        err(status=None, error="connection"),
    ]
    counts = count_outcomes(rs, 500)
    assert sum(counts.values()) == len(rs)
    assert counts == {
        "local_on_time": 1,
        "local_late": 1,
        "cloud": 1,
        "unknown_on_time": 0,
        "unknown_late": 0,
        "rejected": 1,
        "failed": 1,
    }


def test_sustainable_rate_is_the_highest_passing_rate_level():
    levels = [level(2, 0.1, mode="rate"), level(5, 0.2, mode="rate"), level(10, 3.0, mode="rate")]
    judge(levels, SLA(ttft_p99_ms=1000))
    assert sustainable_rate(levels).rate == 5
    conc = [level(1, 0.1), level(8, 0.2), level(32, 5.0)]
    judge(conc, SLA(ttft_p99_ms=1000))
    base = sustainable_rate(conc)
    assert base.rate == pytest.approx(conc[1].requests_per_s) and "concurrency 8" in base.reason
    none_pass = [level(2, 3.0, mode="rate"), level(4, 4.0, mode="rate")]
    judge(none_pass, SLA(ttft_p99_ms=1000))
    assert sustainable_rate(none_pass) is None
    assert fallback_rate(none_pass).rate == 2 and "no level met" in fallback_rate(none_pass).reason


def _timeline(late_until: float, end: float, rate: float = 10.0, ttft_late: float = 2.0):
    """A request every 1/rate s; those arriving before late_until wait ttft_late s, later ones 0.1 s."""
    n = int(end * rate)
    return [ok(i / rate, ttft=ttft_late if i / rate < late_until else 0.1) for i in range(n)]


def test_recovery_is_when_arrivals_are_on_time_again():
    rs = _timeline(late_until=13.0, end=30.0)  # burst ends at 10, the queue drains until 13
    assert recovery_time(rs, 10.0, 30.0, 1000, window_s=2.0) == pytest.approx(3.0, abs=0.11)
    assert recovery_time(_timeline(late_until=8.0, end=30.0), 10.0, 30.0, 1000, 2.0) == 0.0
    assert recovery_time(_timeline(late_until=40.0, end=30.0), 10.0, 30.0, 1000, 2.0) is None


def test_errors_after_the_burst_are_not_a_recovery():
    rs = [ok(i / 10, ttft=0.1) for i in range(100)]  # 0..10 s fine
    rs += [err(10 + i / 10, status=503) for i in range(30)]  # 10..13 s rejected
    rs += [ok(13 + i / 10, ttft=0.1) for i in range(70)]
    assert recovery_time(rs, 10.0, 20.0, 1000, 2.0) == pytest.approx(3.0, abs=0.11)


def test_a_window_must_fit_in_the_watch():
    rs = _timeline(late_until=19.5, end=20.0)
    assert (
        recovery_time(rs, 10.0, 20.0, 1000, 2.0) is None
    )  # one on-time request at the very end is no recovery


def test_poisson_arrivals_are_seeded_and_at_the_asked_rate():
    a = level_arrivals(20.0, 50.0, None, random.Random(1))
    assert a == level_arrivals(20.0, 50.0, None, random.Random(1))
    assert len(a) == pytest.approx(1000, rel=0.1) and all(0 <= x.at_s < 50 for x in a)
    assert [x.at_s for x in a] == sorted(x.at_s for x in a)
    n = level_arrivals(5.0, None, 7, random.Random(2))
    assert len(n) == 7 and n[0].at_s > 0


def test_burst_phases_triple_the_rate_in_the_middle():
    phases = burst_phases(4.0, 3.0, before_s=10, burst_s=20, after_s=40)
    assert phases == [Phase("before", 0, 10, 4.0), Phase("burst", 10, 30, 12.0), Phase("after", 30, 70, 4.0)]
    arrivals = poisson_arrivals(phases, random.Random(0))
    count = {p: sum(1 for a in arrivals if a.phase == p) for p in ("before", "burst", "after")}
    assert count["burst"] == pytest.approx(240, rel=0.2) and count["after"] == pytest.approx(160, rel=0.2)
    assert all(10 <= a.at_s < 30 for a in arrivals if a.phase == "burst")
