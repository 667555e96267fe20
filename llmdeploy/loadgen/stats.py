"""Per-level figures from the requests' results: rates, latency percentiles, errors, backend shares.

Percentiles interpolate linearly between order statistics (numpy's default): with few requests a p99 is close to
the slowest one, so a level of 20 requests reports its p99 as nearly its maximum.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmdeploy.loadgen.results import LoadPoint, RequestResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """q in 0..100; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    if lo == hi or xs[lo] == xs[hi]:  # also keeps inf (a failed request in a burst window) from making nan
        return xs[lo]
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Quantiles:
    """Milliseconds; None where no request gave the figure."""

    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None
    max: float | None = None
    count: int = 0

    @classmethod
    def of_seconds(cls, values: Iterable[float | None]) -> Quantiles:
        ms = [v * 1000 for v in values if v is not None]
        if not ms:
            return cls()
        return cls(
            percentile(ms, 50), percentile(ms, 90), percentile(ms, 99), sum(ms) / len(ms), max(ms), len(ms)
        )


@dataclass
class LevelSummary:
    mode: str
    value: float
    elapsed_s: float
    requests: int
    ok: int
    success_rate: float | None
    errors: dict[str, int]
    requests_per_s: float
    output_tokens_per_s: float
    output_tokens: int
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None
    ttft_ms: Quantiles
    tpot_ms: Quantiles
    e2e_ms: Quantiles
    backends: dict[str, int]  # successful answers by x-llmdeploy-backend
    share: dict[str, float]  # the same as shares of the successful answers
    token_source: dict[str, int]
    by_kind: dict[str, dict[str, Any]]
    arrival_rate: float | None = None  # open loop: arrivals per second actually produced
    server: dict[str, Any] | None = None  # /metrics samples during the level (probe.summarize)
    meets_sla: bool | None = None  # set by verdict.judge
    sla_misses: list[str] = field(default_factory=list)

    @property
    def point(self) -> LoadPoint:
        return LoadPoint(self.mode, self.value)  # type: ignore[arg-type]


def summarize(
    point: LoadPoint, results: Sequence[RequestResult], elapsed_s: float | None = None
) -> LevelSummary:
    """elapsed defaults to the level's span: from its start to the last answer."""
    ok = [r for r in results if r.ok]
    span = elapsed_s if elapsed_s is not None else max((r.end_s for r in results), default=0.0)
    per_s = (lambda n: n / span) if span > 0 else (lambda n: 0.0)
    out_tokens = sum(r.output_tokens for r in ok)
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    backends = Counter(r.backend for r in ok)
    arrival_rate = None
    if point.mode == "rate" and results:
        last_arrival = max(r.arrival_s for r in results)
        arrival_rate = len(results) / last_arrival if last_arrival > 0 else None
    return LevelSummary(
        mode=point.mode,
        value=point.value,
        elapsed_s=span,
        requests=len(results),
        ok=len(ok),
        success_rate=len(ok) / len(results) if results else None,
        errors=dict(Counter(r.error or "unknown" for r in results if not r.ok).most_common()),
        requests_per_s=per_s(len(ok)),
        output_tokens_per_s=per_s(out_tokens),
        output_tokens=out_tokens,
        mean_prompt_tokens=sum(prompts) / len(prompts) if prompts else None,
        mean_output_tokens=out_tokens / len(ok) if ok else None,
        ttft_ms=Quantiles.of_seconds(r.ttft_s for r in ok),
        tpot_ms=Quantiles.of_seconds(r.tpot_s for r in ok),
        e2e_ms=Quantiles.of_seconds(r.e2e_s for r in ok),
        backends=dict(sorted(backends.items())),
        share={b: n / len(ok) for b, n in sorted(backends.items())},
        token_source=dict(Counter(r.token_source for r in ok)),
        by_kind=_by_kind(results),
        arrival_rate=arrival_rate,
    )


def _by_kind(results: Sequence[RequestResult]) -> dict[str, dict[str, Any]]:
    """Long and short prompts apart (a mix's short prompts wait behind the long ones' prefill)."""
    kinds = sorted({r.kind for r in results})
    if len(kinds) < 2:
        return {}
    out = {}
    for kind in kinds:
        rs = [r for r in results if r.kind == kind]
        ok = [r for r in rs if r.ok]
        ttft, e2e = Quantiles.of_seconds(r.ttft_s for r in ok), Quantiles.of_seconds(r.e2e_s for r in ok)
        out[kind] = {
            "requests": len(rs),
            "ok": len(ok),
            "ttft_p50_ms": ttft.p50,
            "ttft_p99_ms": ttft.p99,
            "e2e_p99_ms": e2e.p99,
        }
    return out
