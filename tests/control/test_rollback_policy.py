"""Automatic rollback judgement over a revision's sliding window (pure)."""

from __future__ import annotations

from llmdeploy.policies.rollback import judge_candidate
from llmdeploy.policies.snapshot import WindowStats
from llmdeploy.spec.models import AutoRollbackSpec

LIMITS = AutoRollbackSpec(max_error_rate=0.05, max_ttft_p99_ms=3000, min_requests=20, window_s=60)


def window(requests: int, errors: int = 0, ttft: float | None = 100.0) -> WindowStats:
    return WindowStats(requests, errors, errors / requests if requests else 0.0, ttft, 60.0)


def test_too_few_requests_are_not_judged_even_if_all_failed():
    d = judge_candidate(window(19, errors=19, ttft=99999), LIMITS)
    assert not d.rollback and "19 of 20" in d.reason


def test_error_rate_over_the_limit_rolls_back_with_the_numbers():
    d = judge_candidate(window(40, errors=3), LIMITS)
    assert d.rollback
    assert "error rate 7.5% > max_error_rate 5.0%" in d.reason and "40 requests" in d.reason
    assert d.numbers() == {
        "requests": 40,
        "errors": 3,
        "error_rate": 0.075,
        "ttft_p99_ms": 100.0,
        "window_s": 60.0,
        "max_error_rate": 0.05,
        "max_ttft_p99_ms": 3000,
        "min_requests": 20,
    }


def test_error_rate_at_the_limit_is_allowed():
    assert not judge_candidate(window(100, errors=5), LIMITS).rollback


def test_slow_first_tokens_roll_back():
    d = judge_candidate(window(20, ttft=3500.0), LIMITS)
    assert d.rollback and "TTFT p99 3500.0 ms > max_ttft_p99_ms 3000 ms" in d.reason


def test_healthy_candidate_and_unknown_ttft_are_kept():
    assert not judge_candidate(window(500, errors=1, ttft=2999.0), LIMITS).rollback
    d = judge_candidate(window(50, ttft=None), LIMITS)
    assert not d.rollback and d.reason.startswith("within limits")


def test_disabled_never_rolls_back():
    off = LIMITS.model_copy(update={"enabled": False})
    d = judge_candidate(window(100, errors=100, ttft=1e6), off)
    assert not d.rollback and d.reason == "auto-rollback is disabled"
