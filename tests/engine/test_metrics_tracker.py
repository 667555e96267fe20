"""The server's per-request histograms, fed by RequestTracker from the engine's outputs (no model needed)."""

from __future__ import annotations

from llmdeploy.engine.metrics import ServerMetrics
from llmdeploy.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput


def output(tokens: list[int], first: float, last: float, finished: bool = False) -> RequestOutput:
    c = CompletionOutput(0, "", tokens, None, "length" if finished else None, None, delta_token_ids=tokens)
    return RequestOutput(
        "r", [1, 2], [c], finished, 0, RequestMetrics(0.0, 0.0, first, last, last if finished else None)
    )


def itl_samples(m: ServerMetrics) -> tuple[float, float]:
    """(count, sum) of the inter-token histogram."""
    values = {s.name: s.value for fam in m.registry.collect() for s in fam.samples}
    return values["llmdeploy:inter_token_latency_seconds_count"], values[
        "llmdeploy:inter_token_latency_seconds_sum"
    ]


def metrics() -> ServerMetrics:
    return ServerMetrics(lambda: EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0), "m")


def test_tokens_delivered_one_by_one_count_one_gap_each():
    m = metrics()
    t = m.tracker()
    for i in range(5):
        t.on_output(output([i], first=1.0, last=1.0 + 0.1 * i, finished=i == 4))
    count, total = itl_samples(m)
    assert count == 4 and abs(total - 0.4) < 1e-9


def test_tokens_merged_by_a_slow_consumer_still_count_one_gap_each():
    """All five tokens in one output (the consumer fell behind): four gaps, timed by the engine, not by arrival."""
    m = metrics()
    m.tracker().on_output(output([1, 2, 3, 4, 5], first=1.0, last=1.4, finished=True))
    count, total = itl_samples(m)
    assert count == 4 and abs(total - 0.4) < 1e-9


def test_merged_after_the_first_output():
    m = metrics()
    t = m.tracker()
    t.on_output(output([1], first=1.0, last=1.0))
    t.on_output(output([2, 3], first=1.0, last=1.3, finished=True))
    count, total = itl_samples(m)
    assert count == 2 and abs(total - 0.3) < 1e-9
