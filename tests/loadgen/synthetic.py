"""Synthetic request results for the pure logic's tests (what a run would have recorded)."""

from __future__ import annotations

from llmdeploy.loadgen.results import LoadPoint, RequestResult
from llmdeploy.loadgen.stats import LevelSummary, summarize


def ok(
    arrival: float = 0.0,
    ttft: float = 0.1,
    e2e: float = 1.0,
    tokens: int = 10,
    backend: str = "local",
    kind: str = "synthetic",
    phase: str = "",
) -> RequestResult:
    return RequestResult(
        arrival, arrival + e2e, True, kind, backend, 200, None, ttft, tokens, 50, "usage", phase
    )  # type: ignore[arg-type]


def err(
    arrival: float = 0.0,
    status: int | None = 503,
    error: str = "http_503:overloaded",
    phase: str = "",
    after: float = 0.01,
) -> RequestResult:
    return RequestResult(arrival, arrival + after, False, "synthetic", "none", status, error, phase=phase)


def level(
    value: float,
    ttft_s: float,
    n: int = 20,
    failures: int = 0,
    mode: str = "concurrency",
    tpot_s: float = 0.02,
) -> LevelSummary:
    """n requests at this load, all with the same TTFT; 10 tokens each so TPOT = (e2e - ttft) / 9."""
    rs = [ok(i * 0.1, ttft_s, ttft_s + 9 * tpot_s) for i in range(n - failures)]
    rs += [err(i * 0.1) for i in range(failures)]
    return summarize(LoadPoint(mode, value), rs)  # type: ignore[arg-type]
