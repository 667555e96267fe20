"""Token buckets: per-key `rpm` limits (429) and the local burst rate (`routing.burst.local_rps`).

Time is passed in, never read, so tests drive the clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenBucket:
    rate_per_s: float
    capacity: float
    tokens: float = -1.0  # -1: full on first use
    stamp: float | None = None

    def _refill(self, now: float) -> None:
        if self.stamp is None or self.tokens < 0:
            self.tokens, self.stamp = self.capacity, now
            return
        self.tokens = min(self.capacity, self.tokens + max(0.0, now - self.stamp) * self.rate_per_s)
        self.stamp = now

    def try_take(self, now: float, n: float = 1.0) -> bool:
        self._refill(now)
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False

    def retry_after(self, now: float, n: float = 1.0) -> float:
        """Seconds until `n` tokens are there (0 when they already are)."""
        self._refill(now)
        return max(0.0, (n - self.tokens) / self.rate_per_s)

    def reconfigure(self, rate_per_s: float, capacity: float) -> None:
        self.rate_per_s, self.capacity = rate_per_s, capacity
        if self.tokens > capacity:
            self.tokens = capacity


def rpm_bucket(rpm: int) -> TokenBucket:
    # a full minute's worth may arrive at once, as OpenAI's limits allow
    return TokenBucket(rate_per_s=rpm / 60.0, capacity=float(rpm))


def burst_bucket(local_rps: float) -> TokenBucket:
    # one second of burst above the steady rate
    return TokenBucket(rate_per_s=local_rps, capacity=max(1.0, local_rps))


class KeyRateLimiter:
    """rpm per key name; keys without a limit always pass."""

    def __init__(self) -> None:
        self._buckets: dict[str, TokenBucket] = {}

    def configure(self, limits: dict[str, int | None]) -> None:
        """Hot reload: keep the state of keys whose limit survives, drop the rest."""
        for name, rpm in limits.items():
            if rpm is None:
                self._buckets.pop(name, None)
            elif name in self._buckets:
                self._buckets[name].reconfigure(rpm / 60.0, float(rpm))
            else:
                self._buckets[name] = rpm_bucket(rpm)
        for name in set(self._buckets) - set(limits):
            del self._buckets[name]

    def check(self, key_name: str, now: float) -> float | None:
        """None: allowed (and counted); else seconds to wait before retrying."""
        bucket = self._buckets.get(key_name)
        if bucket is None or bucket.try_take(now):
            return None
        return max(bucket.retry_after(now), 0.001)
