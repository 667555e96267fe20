"""The burst drill's arithmetic: which rate is sustainable, what became of each request, when TTFT recovered.

Outcomes of a request (the TTFT target decides "late"):
  local_on_time / local_late      served by the local engine (x-llmdeploy-backend: local)
  cloud                           served by the cloud, whatever its TTFT
  unknown_on_time / unknown_late  served, by a server that does not say which backend (no llmdeploy router)
  rejected                        refused with 429 or 503 (too busy)
  failed                          any other error (timeouts, connection, other HTTP errors)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from llmdeploy.loadgen.results import RequestResult
from llmdeploy.loadgen.stats import LevelSummary, percentile

Outcome = Literal[
    "local_on_time", "local_late", "cloud", "unknown_on_time", "unknown_late", "rejected", "failed"
]
OUTCOMES: tuple[Outcome, ...] = (
    "local_on_time",
    "local_late",
    "cloud",
    "unknown_on_time",
    "unknown_late",
    "rejected",
    "failed",
)


def classify(r: RequestResult, ttft_target_ms: float) -> Outcome:
    if not r.ok:
        return "rejected" if r.rejected else "failed"
    if r.backend == "cloud":
        return "cloud"
    late = r.ttft_s is not None and r.ttft_s * 1000 > ttft_target_ms
    if r.backend == "local":
        return "local_late" if late else "local_on_time"
    return "unknown_late" if late else "unknown_on_time"


def count_outcomes(results: Sequence[RequestResult], ttft_target_ms: float) -> dict[str, int]:
    c = Counter(classify(r, ttft_target_ms) for r in results)
    return {o: c.get(o, 0) for o in OUTCOMES}


@dataclass(frozen=True)
class BaseRate:
    rate: float
    reason: str


def sustainable_rate(levels: Sequence[LevelSummary]) -> BaseRate | None:
    """The highest rate level that met the SLA; without rate levels, the measured requests/s of the highest
    concurrency level that met it. None when no level met the SLA."""
    passing = [lv for lv in levels if lv.meets_sla]
    rates = [lv for lv in passing if lv.mode == "rate"]
    if rates:
        best = max(rates, key=lambda lv: lv.value)
        return BaseRate(best.value, f"highest rate level that met the SLA ({best.value:g}/s)")
    conc = [lv for lv in passing if lv.mode == "concurrency" and lv.requests_per_s > 0]
    if conc:
        best = max(conc, key=lambda lv: lv.value)
        return BaseRate(
            best.requests_per_s,
            f"requests/s measured at concurrency {best.value:g}, the highest level that met the SLA",
        )
    return None


def fallback_rate(levels: Sequence[LevelSummary]) -> BaseRate | None:
    """No level met the SLA: drill from the lightest load anyway, so the user still sees what a burst does."""
    rates = sorted((lv for lv in levels if lv.mode == "rate"), key=lambda lv: lv.value)
    if rates:
        return BaseRate(rates[0].value, f"no level met the SLA; the lowest rate level ({rates[0].value:g}/s)")
    conc = sorted((lv for lv in levels if lv.requests_per_s > 0), key=lambda lv: lv.value)
    if conc:
        lv = conc[0]
        return BaseRate(
            lv.requests_per_s, f"no level met the SLA; requests/s measured at concurrency {lv.value:g}"
        )
    return None


def window_p99_ms(results: Sequence[RequestResult], start_s: float, end_s: float) -> float | None:
    """p99 TTFT of the requests that arrived in [start, end); a failed request counts as infinitely late
    (a service answering with errors has not recovered)."""
    xs = [
        (r.ttft_s * 1000 if r.ok and r.ttft_s is not None else float("inf"))
        for r in results
        if start_s <= r.arrival_s < end_s
    ]
    return percentile(xs, 99) if xs else None


def recovery_time(
    results: Sequence[RequestResult],
    burst_end_s: float,
    watch_end_s: float,
    ttft_target_ms: float,
    window_s: float,
) -> float | None:
    """Seconds from the burst's end to the first arrival from which the next `window_s` of arrivals have their
    p99 TTFT within the target (looking forward, so requests of the burst itself do not weigh on it): 0.0 when
    the requests right after the burst are already on time; None when that did not happen while the drill
    watched (only whole windows inside the watch count)."""
    later = sorted(r.arrival_s for r in results if burst_end_s < r.arrival_s <= watch_end_s - window_s)
    for start in [burst_end_s, *later]:
        p99 = window_p99_ms(results, start, start + window_s)
        if p99 is not None and p99 <= ttft_target_ms:
            return start - burst_end_s
    return None


def rolling_window_s(base_rate: float) -> float:
    """About 20 requests at the sustainable rate, at least 1 s: fewer make the p99 a single request's luck."""
    return max(1.0, 20.0 / base_rate)
