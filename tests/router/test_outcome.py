"""A request's typed Outcome (router/outcome.py) and its one writer, the Bookkeeper (router/bookkeeping.py):
what a finished Call concludes to, and that recording it writes the metrics, the revision window and the
access log once, with the real metrics registry, windows and observer."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from llmdeploy.router.bookkeeping import Bookkeeper
from llmdeploy.router.dashboard_data import Observer
from llmdeploy.router.metrics import RouterMetrics
from llmdeploy.router.outcome import AttemptFailure, Call, conclude
from llmdeploy.router.relay import Exchange
from llmdeploy.router.settings import build_settings
from llmdeploy.router.windows import RevisionWindows
from tests.router.conftest import ALIAS, ENV, make_spec


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def settings():
    s = build_settings(make_spec(), {}, ENV, 0.02)
    yield s
    asyncio.run(s.cloud.aclose())


@pytest.fixture
def books():
    metrics = RouterMetrics()
    windows = RevisionWindows(60.0)
    return Bookkeeper(metrics, windows, Observer(metrics), clock=Clock()), metrics, windows


def new_call(rid: str = "rid-1", stream: bool = True) -> Call:
    ex = Exchange(ALIAS, False, started=90.0)
    return Call(rid, "chat/completions", ex, key="app", stream=stream)


def sample(metrics: RouterMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(f"llmdeploy_router_{name}", labels)
    return value or 0.0


def test_conclude_sums_up_the_call():
    call = new_call()
    call.ex.first_token_at, call.ex.content_events, call.ex.prompt_tokens = 90.25, 7, 12
    call.overflow, call.capability, call.attempts, call.replica = "burst", "any", 2, "r1"
    call.failures.append(AttemptFailure("cloud", "timeout", True))
    o = conclude(call, 92.0, 200, "local", 3)
    assert (o.served_by, o.revision, o.status, o.error) == ("local", 3, 200, None)
    assert o.completion_tokens == 7  # no usage in the stream: one token per content event
    assert o.prompt_tokens == 12 and o.ttft_s == pytest.approx(0.25) and o.total_s == pytest.approx(2.0)
    assert (o.overflow, o.capability, o.attempts, o.replica) == ("burst", "any", 2, "r1")
    assert o.failures == (AttemptFailure("cloud", "timeout", True),) and o.revision_label == "3"
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.status = 500  # type: ignore[misc]
    call.failures.append(AttemptFailure("local", "connect_error", True))
    assert len(o.failures) == 1  # the outcome does not follow the call after it


def test_revision_labels_name_the_cloud_and_nobody():
    call = new_call()
    assert conclude(call, 91.0, 200, "cloud", 3).revision_label == "cloud"
    assert conclude(call, 91.0, 503, "none", 3).revision_label == "none"
    assert conclude(call, 91.0, 200, "local", None).revision_label == "none"


def test_an_outcome_is_recorded_once_everywhere(books, settings, caplog):
    bk, metrics, windows = books
    call = new_call()
    call.ex.first_token_at, call.ex.completion_tokens, call.ex.prompt_tokens = 90.5, 4, 9
    call.capability, call.failovers = "none", [("local", "local")]
    call.failures.append(AttemptFailure("local", "connect_error", True))
    call.failures.append(AttemptFailure("local", "context_length", False))
    bk.arrived()
    outcome = conclude(call, 91.0, 200, "local", 2)
    caplog.set_level(logging.INFO, "llmdeploy.router.access")
    bk.record(call, outcome, settings)
    bk.record(call, outcome, settings)  # a second report of the same call changes nothing
    assert sample(metrics, "requests_total", backend="local", revision="2", status="200") == 1
    assert sample(metrics, "key_requests_total", key="app", status="200") == 1
    assert sample(metrics, "inflight_requests") == 0
    assert sample(metrics, "capability_decisions_total", decision="none") == 1
    assert sample(metrics, "failovers_total", from_backend="local", to_backend="local") == 1
    assert sample(metrics, "upstream_errors_total", backend="local", type="connect_error") == 1
    assert sample(metrics, "upstream_errors_total", backend="local", type="context_length") == 1
    assert sample(metrics, "ttft_seconds_count", backend="local", revision="2") == 1
    assert sample(metrics, "tokens_total", backend="local", direction="out") == 4
    w = windows.stats(2, 100.0)  # the fault before the answer and the answer; not the client's own error
    assert (w.requests, w.errors, w.ttft_p99_ms) == (2, 1, 500.0)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "llmdeploy.router.access"]
    assert "rid=rid-1" in line and "status=200" in line and "backend=local" in line and "revision=2" in line


def test_a_refusal_and_a_cloud_answer_are_booked_apart(books, settings):
    bk, metrics, windows = books
    refused, served = new_call("rid-2", stream=False), new_call("rid-3")
    served.overflow, served.ex.prompt_tokens, served.ex.completion_tokens = "predicted_ttft", 5, 6
    for call, o in (
        (refused, conclude(refused, 91.0, 503, "none", 1, "overloaded")),
        (served, conclude(served, 91.0, 200, "cloud", 1)),
    ):
        bk.arrived()
        bk.record(call, o, settings)
    assert sample(metrics, "requests_total", backend="none", revision="none", status="503") == 1
    assert sample(metrics, "errors_total", type="overloaded") == 1
    assert sample(metrics, "requests_total", backend="cloud", revision="cloud", status="200") == 1
    assert sample(metrics, "overflow_total", reason="predicted_ttft") == 1
    assert sample(metrics, "cloud_tokens_total", direction="in") == 5
    assert sample(metrics, "cloud_tokens_total", direction="out") == 6
    assert windows.stats(1, 100.0).requests == 0  # only local answers judge a revision


def test_only_a_plan_that_starts_locally_reserves_its_replica():
    """A cloud-first plan (SLA overflow, burst) keeps its local replica as a fallback only: reserving it made each
    request the cloud was serving count as queued on the engine, and the predicted TTFT then kept even an idle
    engine out of the traffic (bench at concurrency 16 and 32 with the cloud on: 1% and 0% local)."""
    from llmdeploy.policies.route import CLOUD_TARGET, Decision, Target
    from llmdeploy.policies.snapshot import EngineLoad, ReplicaState
    from llmdeploy.router.dispatch import reservation

    replica = ReplicaState("http://127.0.0.1:1", "r1", 1, EngineLoad())
    local = Target("local", replica)
    assert reservation(Decision("local", 1, (local, CLOUD_TARGET))) == replica.url
    assert reservation(Decision("cloud", 1, (CLOUD_TARGET, local), "predicted_ttft")) is None
    assert reservation(Decision("cloud", None, (CLOUD_TARGET,))) is None
    assert reservation(Decision("wait", 1)) is None
