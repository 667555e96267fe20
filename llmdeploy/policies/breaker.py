"""Circuit breaker per backend: closed -> open (consecutive failures or error rate over a window) ->
half-open after a cooldown (one probe request) -> closed on its success, open again on its failure.

Time is passed in, so tests drive the clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
MIN_CALLS_FOR_RATE = 10  # the error-rate rule needs enough calls to mean something


@dataclass
class BreakerConfig:
    consecutive_failures: int = 5
    error_rate: float = 0.5
    window_s: float = 30.0
    cooldown_s: float = 10.0

    @classmethod
    def from_spec(cls, spec) -> BreakerConfig:
        return cls(spec.consecutive_failures, spec.error_rate, spec.window_s, spec.cooldown_s)


@dataclass
class CircuitBreaker:
    config: BreakerConfig = field(default_factory=BreakerConfig)
    state: str = CLOSED
    consecutive: int = 0
    opened_at: float = 0.0
    probe_in_flight: bool = False
    calls: deque = field(default_factory=deque)  # (time, failed)

    def allows(self, now: float) -> bool:
        """May a request be sent now? Does not reserve the half-open probe (see acquire)."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            return now - self.opened_at >= self.config.cooldown_s
        return not self.probe_in_flight

    def acquire(self, now: float) -> bool:
        """Like allows(), but takes the single half-open probe slot when the breaker is not closed."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN and now - self.opened_at >= self.config.cooldown_s:
            self.state = HALF_OPEN
            self.probe_in_flight = False
        if self.state == HALF_OPEN and not self.probe_in_flight:
            self.probe_in_flight = True
            return True
        return False

    def record(self, ok: bool, now: float) -> None:
        if self.state == HALF_OPEN:
            self.probe_in_flight = False
            if ok:
                self._close()
            else:
                self._open(now)
            return
        if self.state == OPEN:
            return  # results of requests sent before it opened change nothing
        self.calls.append((now, not ok))
        self._prune(now)
        self.consecutive = 0 if ok else self.consecutive + 1
        if not ok and (self.consecutive >= self.config.consecutive_failures or self._rate_exceeded()):
            self._open(now)

    def release(self) -> None:
        """The probe slot was taken but no request went out (e.g. another backend was used)."""
        self.probe_in_flight = False

    def reconfigure(self, config: BreakerConfig) -> None:
        self.config = config

    def _rate_exceeded(self) -> bool:
        if len(self.calls) < MIN_CALLS_FOR_RATE:
            return False
        failures = sum(1 for _, failed in self.calls if failed)
        return failures / len(self.calls) >= self.config.error_rate

    def _prune(self, now: float) -> None:
        while self.calls and now - self.calls[0][0] > self.config.window_s:
            self.calls.popleft()

    def _open(self, now: float) -> None:
        self.state, self.opened_at, self.consecutive = OPEN, now, 0
        self.calls.clear()

    def _close(self) -> None:
        self.state, self.consecutive = CLOSED, 0
        self.calls.clear()
