"""Per-revision sliding windows of outcomes and TTFT: what auto-rollback judges (CONTRACTS.md section 5)."""

from __future__ import annotations

import math
from collections import deque

from llmdeploy.policies.snapshot import WindowStats

__all__ = ["RevisionWindows", "WindowStats", "p99"]


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class RevisionWindows:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._events: dict[int, deque] = {}  # revision -> (time, failed, ttft_ms | None)

    def record(self, revision: int, failed: bool, ttft_ms: float | None, now: float) -> None:
        q = self._events.setdefault(revision, deque())
        q.append((now, failed, ttft_ms))
        self._prune(q, now)

    def stats(self, revision: int, now: float) -> WindowStats:
        q = self._events.get(revision)
        if not q:
            return WindowStats(window_s=self.window_s)
        self._prune(q, now)
        n = len(q)
        errors = sum(1 for _, failed, _ in q if failed)
        ttfts = [t for _, _, t in q if t is not None]
        return WindowStats(n, errors, errors / n if n else 0.0, p99(ttfts), self.window_s)

    def _prune(self, q: deque, now: float) -> None:
        while q and now - q[0][0] > self.window_s:
            q.popleft()
