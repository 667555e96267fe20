"""A small in-memory time series of what the router answered: requests, errors and tokens per backend, TTFT per
revision, in fixed-width buckets. The Bookkeeper (through Observer.record) is its one writer; the dashboard,
status and the cost figures read it. Kept in memory only: a daemon restart starts it empty (Prometheus keeps
the long history).

Two resolutions: 10 s buckets for the last hour (charts, canary vs stable) and 1 min buckets for the last day
(the spill's cost over a day).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from llmdeploy.policies.cost import Tokens

FINE_S, FINE_KEEP = 10.0, 360  # one hour
COARSE_S, COARSE_KEEP = 60.0, 1440  # one day
MAX_TTFT_SAMPLES = 2000  # per revision per fine bucket: enough for a p99, bounded under any load
BACKENDS = ("local", "cloud")


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..1), like the auto-rollback windows'."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class Bucket:
    start: float
    requests: dict[str, int] = field(default_factory=dict)  # backend -> answered
    errors: dict[str, int] = field(default_factory=dict)  # backend -> 5xx or broken after the first byte
    tokens_in: dict[str, int] = field(default_factory=dict)
    tokens_out: dict[str, int] = field(default_factory=dict)
    rev_requests: dict[int, int] = field(default_factory=dict)  # local answers per revision
    rev_errors: dict[int, int] = field(default_factory=dict)
    rev_ttft_ms: dict[int, list[float]] = field(default_factory=dict)


def _add(d: dict, k: Any, n: int) -> None:
    d[k] = d.get(k, 0) + n


class Ring:
    """Buckets of `width_s` seconds, the newest `keep` of them, aligned to multiples of width_s."""

    def __init__(self, width_s: float, keep: int) -> None:
        self.width_s, self.keep = width_s, keep
        self.buckets: deque[Bucket] = deque()

    def bucket(self, now: float) -> Bucket:
        start = math.floor(now / self.width_s) * self.width_s
        if not self.buckets or self.buckets[-1].start < start:
            self.buckets.append(Bucket(start))
            while len(self.buckets) > self.keep or self.buckets[0].start <= start - self.keep * self.width_s:
                self.buckets.popleft()
        return self.buckets[-1]  # a clock stepping back books into the newest bucket

    def since(self, now: float, span_s: float) -> list[Bucket]:
        return [b for b in self.buckets if b.start > now - span_s - self.width_s and b.start <= now]


class TrafficSeries:
    def __init__(self) -> None:
        self.fine = Ring(FINE_S, FINE_KEEP)
        self.coarse = Ring(COARSE_S, COARSE_KEEP)

    def record(
        self,
        now: float,
        backend: str,
        revision: int | None,
        error: bool,
        ttft_ms: float | None,
        tokens_in: int,
        tokens_out: int,
    ) -> None:
        """One answered request (backend local or cloud; requests no backend served are not traffic)."""
        for ring in (self.fine, self.coarse):
            b = ring.bucket(now)
            _add(b.requests, backend, 1)
            _add(b.errors, backend, int(error))
            _add(b.tokens_in, backend, tokens_in)
            _add(b.tokens_out, backend, tokens_out)
        if backend == "local" and revision is not None:
            b = self.fine.bucket(now)
            _add(b.rev_requests, revision, 1)
            _add(b.rev_errors, revision, int(error))
            if ttft_ms is not None:
                samples = b.rev_ttft_ms.setdefault(revision, [])
                if len(samples) < MAX_TTFT_SAMPLES:
                    samples.append(ttft_ms)

    # ---- reads ---------------------------------------------------------------------------------------------
    def tokens(self, now: float, span_s: float, backend: str) -> Tokens:
        ring = self.fine if span_s <= FINE_S * FINE_KEEP else self.coarse
        bs = ring.since(now, span_s)
        return Tokens(
            sum(b.tokens_in.get(backend, 0) for b in bs), sum(b.tokens_out.get(backend, 0) for b in bs)
        )

    def points(self, now: float, span_s: float) -> list[dict[str, Any]]:
        """One point per fine bucket over the span (empty buckets included, so charts keep their time axis)."""
        by_start = {b.start: b for b in self.fine.since(now, span_s)}
        first = math.floor((now - span_s) / FINE_S) * FINE_S + FINE_S
        out = []
        t = first
        while t <= now:
            b = by_start.get(t) or Bucket(t)
            out.append(
                {
                    "t": t,
                    **{f"{k}_requests": b.requests.get(k, 0) for k in BACKENDS},
                    **{f"{k}_tokens": b.tokens_in.get(k, 0) + b.tokens_out.get(k, 0) for k in BACKENDS},
                    "errors": sum(b.errors.values()),
                    "ttft_p50_ms": {str(r): percentile(v, 0.5) for r, v in b.rev_ttft_ms.items()},
                    "ttft_p99_ms": {str(r): percentile(v, 0.99) for r, v in b.rev_ttft_ms.items()},
                }
            )
            t += FINE_S
        return out

    def revision_stats(self, now: float, span_s: float, revision: int) -> dict[str, Any]:
        """Local answers of one revision over the span: requests, error rate, TTFT p50/p99."""
        bs = self.fine.since(now, span_s)
        n = sum(b.rev_requests.get(revision, 0) for b in bs)
        errors = sum(b.rev_errors.get(revision, 0) for b in bs)
        ttfts = [t for b in bs for t in b.rev_ttft_ms.get(revision, [])]
        return {
            "requests": n,
            "errors": errors,
            "error_rate": errors / n if n else 0.0,
            "ttft_p50_ms": percentile(ttfts, 0.5),
            "ttft_p99_ms": percentile(ttfts, 0.99),
            "span_s": span_s,
        }

    def share(self, now: float, span_s: float) -> dict[str, Any]:
        bs = self.fine.since(now, span_s) if span_s <= FINE_S * FINE_KEEP else self.coarse.since(now, span_s)
        served = {k: sum(b.requests.get(k, 0) for b in bs) for k in BACKENDS}
        total = sum(served.values())
        return {
            "requests": served,
            "cloud_share": served["cloud"] / total if total else 0.0,
            "span_s": span_s,
        }
