"""The step-cost model fitted from the engine's own steps (the value type is llmdeploy/policies/step_cost.py).

Weighted least squares of step time on [1, effective prefill tokens, decoding sequences]:
- the warm-up's measured steps (a short and a long prefill, decodes at batch 1 and wider) are a prior that never
  decays, so the slope stays known when recent traffic has no spread (only 3-token prompts, say);
- each real step is an observation whose weight decays per step and over idle time, so the fit follows a
  machine that got busier or faster, and after a long idle period it rests on the calibration again.
A 3x3 solve per step is a few microseconds of Python.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from llmdeploy.policies.step_cost import StepCost

STEP_DECAY = 0.97  # per observed step: the last ~30 steps carry most of the weight
IDLE_DECAY_S = 120.0  # and over wall time, so an idle engine's fit returns to its calibration
PRIOR_WEIGHT = 2.0  # each warm-up point counts as two recent steps
ERROR_WINDOW = 64
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class CostPoint:
    """One measured step: effective prefill tokens, decoding sequences, seconds."""

    prefill_tokens: float
    decodes: int
    seconds: float


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting for a small system; None when singular."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-18:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


class _Sums:
    """Weighted sufficient statistics X'WX and X'Wy of x = [1, p, d] (X'WX symmetric: six sums). Plain floats:
    the engine updates them every step, on caches the step's weights have just evicted."""

    __slots__ = ("w", "p", "d", "pp", "pd", "dd", "y", "py", "dy")

    def __init__(self) -> None:
        self.w = self.p = self.d = self.pp = self.pd = self.dd = self.y = self.py = self.dy = 0.0

    def add(self, p: float, d: float, y: float, w: float) -> None:
        wp, wd = w * p, w * d
        self.w += w
        self.p += wp
        self.d += wd
        self.pp += wp * p
        self.pd += wp * d
        self.dd += wd * d
        self.y += w * y
        self.py += wp * y
        self.dy += wd * y

    def __add__(self, other: _Sums) -> _Sums:
        out = _Sums()
        for name in _Sums.__slots__:
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def scale(self, f: float) -> None:
        for name in _Sums.__slots__:
            setattr(self, name, getattr(self, name) * f)

    @property
    def xx(self) -> list[list[float]]:
        return [[self.w, self.p, self.d], [self.p, self.pp, self.pd], [self.d, self.pd, self.dd]]

    @property
    def xy(self) -> list[float]:
        return [self.y, self.py, self.dy]


def fit_points(points: list[CostPoint], attn_cost_context: float | None = None) -> StepCost:
    """Least squares over measured points (the warm-up), coefficients kept non-negative."""
    sums = _Sums()
    for pt in points:
        sums.add(pt.prefill_tokens, pt.decodes, pt.seconds, 1.0)
    return _coefficients(sums, None, attn_cost_context)


def _coefficients(
    sums: _Sums, fallback: StepCost | None, attn: float | None, margin: float = 0.0
) -> StepCost:
    theta = _nonnegative_fit(sums)
    if theta is None:
        return fallback if fallback is not None else StepCost(0.0, 0.0, 0.0, margin, attn)
    if theta[0] + theta[2] <= 0 and fallback is not None and fallback.decode_step_s(1) > 0:
        # Both decode terms pinned at zero: a busy machine's mixed steps ran faster than its prefill-only ones and
        # short prompts near zero (the schemathesis fuzz did it). A decode step is never free, and /load, TPOT and
        # slot waits divide by or add it: the previous decode terms stay, the prefill rate is refitted with them.
        fixed, per_seq = fallback.fixed_s, fallback.decode_seq_s
        theta = [fixed, _prefill_rate_given(sums, fixed, per_seq), per_seq]
    return StepCost(*theta, margin, attn)


def _prefill_rate_given(sums: _Sums, fixed_s: float, decode_seq_s: float) -> float:
    """The least-squares prefill rate (>= 0) with the fixed and per-sequence terms held."""
    if sums.pp <= 0:
        return 0.0
    return max(0.0, (sums.py - fixed_s * sums.p - decode_seq_s * sums.pd) / sums.pp)


def _nonnegative_fit(sums: _Sums) -> list[float] | None:
    """Least squares with every coefficient >= 0: a negative one is noise in a fit without spread, so it is
    pinned at zero and the rest refitted (an active-set pass over three unknowns)."""
    xx, xy = sums.xx, sums.xy
    free = [i for i in range(3) if xx[i][i] > 0]  # a feature never seen (no decodes yet) stays at zero
    while free:
        sol = _solve([[xx[i][j] for j in free] for i in free], [xy[i] for i in free])
        if sol is None or any(not math.isfinite(v) for v in sol):
            return None
        if min(sol) >= 0:
            theta = [0.0, 0.0, 0.0]
            for i, v in zip(free, sol, strict=True):
                theta[i] = v
            return theta
        free.pop(min(range(len(sol)), key=lambda k: sol[k]))
    return None


class StepCostMeter:
    """One writer: the engine's step loop calls observe(); /load and the scheduler read current()."""

    def __init__(self, calibration: list[CostPoint], attn_cost_context: float | None = None) -> None:
        self.attn_cost_context = attn_cost_context
        self.prior = _Sums()
        for pt in calibration:
            self.prior.add(pt.prefill_tokens, pt.decodes, pt.seconds, PRIOR_WEIGHT)
        self.calibrated = _coefficients(self.prior, None, attn_cost_context)
        self.recent = _Sums()
        self.last_observed = time.monotonic()
        self.errors: deque[float] = deque(maxlen=ERROR_WINDOW)
        self.decode_step_s: dict[int, float] = {}  # batch bucket -> EWMA of decode-only steps
        self._current = self.calibrated

    def observe(self, prefill_tokens: float, decodes: int, seconds: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        predicted = self._current.step_s(prefill_tokens, decodes)
        if predicted > 0:
            self.errors.append((seconds - predicted) / predicted)
        idle = max(0.0, now - self.last_observed - seconds)
        self.recent.scale(STEP_DECAY * math.exp(-idle / IDLE_DECAY_S))
        self.recent.add(prefill_tokens, decodes, seconds, 1.0)
        self.last_observed = now
        if not prefill_tokens and decodes:
            bucket = min((b for b in BATCH_BUCKETS if b >= decodes), default=BATCH_BUCKETS[-1])
            old = self.decode_step_s.get(bucket)
            self.decode_step_s[bucket] = seconds if old is None else old + 0.2 * (seconds - old)
        self._current = self._fit()

    def _fit(self) -> StepCost:
        return _coefficients(self.prior + self.recent, self._current, self.attn_cost_context, self.margin())

    def margin(self) -> float:
        """About the p90 of how much recent steps ran over their prediction (0 when they ran under)."""
        if len(self.errors) < 8:
            return 0.25  # few steps seen: assume a quarter
        ordered = sorted(self.errors)
        return max(0.0, ordered[int(0.9 * (len(ordered) - 1))])

    def current(self) -> StepCost:
        return self._current
