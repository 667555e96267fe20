"""The step-cost model fitted from the engine's own steps (the value type is llmdeploy/policies/step_cost.py).

Weighted least squares of step time on [1, has a prefill chunk, effective prefill tokens, decoding sequences]
(a step with prefill tokens runs the Python layers; a decode-only one is one native call on CPU, 2-3x cheaper at
batch 1, so one intercept for both made a 16-token prompt's TTFT 1.5x what it took, or a decode step 3-4x):
- the warm-up's measured steps (a short and a long prefill, decodes at batch 1 and wider) are a prior that never
  decays, so the slope stays known when recent traffic has no spread (only 3-token prompts, say);
- each real step is an observation whose weight decays per step and over idle time, so the fit follows a
  machine that got busier or faster, and after a long idle period it rests on the calibration again.
A 4x4 solve is tens of microseconds of Python: done when the fit is read (`current()`), not after every step.
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
OUTLIER_CLIP = 2.0  # a step counts at most this times its prediction (see observe)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class CostPoint:
    """One measured step: effective prefill tokens, decoding sequences, seconds."""

    prefill_tokens: float
    decodes: int
    seconds: float


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting for a small system; None when singular: a pivot that is rounding
    noise beside its column's own scale (two features that were equal in every step, say)."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b, strict=True)]
    scale = [max(abs(row[col]) for row in a) for col in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= max(1e-18, 1e-10 * scale[col]):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


# the fit's features, in StepCost's terms: every step, a step with a prefill chunk, its effective prefill tokens,
# its decoding sequences
FIXED, PREFILL_STEP, PREFILL_TOKEN, DECODE_SEQ = range(4)
N_FEATURES = 4


def _features(p: float, d: float) -> tuple[float, float, float, float]:
    return (1.0, 1.0 if p > 0 else 0.0, p, float(d))


class _Sums:
    """Weighted sufficient statistics X'WX and X'Wy of the features. Plain floats: the engine updates them every
    step, on caches the step's weights have just evicted."""

    __slots__ = ("xx", "xy")

    def __init__(self) -> None:
        self.xx = [[0.0] * N_FEATURES for _ in range(N_FEATURES)]
        self.xy = [0.0] * N_FEATURES

    def add(self, p: float, d: float, y: float, w: float) -> None:
        x = _features(p, d)
        for i, xi in enumerate(x):
            if xi:
                wx, row = w * xi, self.xx[i]
                for j, xj in enumerate(x):
                    row[j] += wx * xj
                self.xy[i] += wx * y

    def __add__(self, other: _Sums) -> _Sums:
        out = _Sums()
        out.xx = [[a + b for a, b in zip(r, o, strict=True)] for r, o in zip(self.xx, other.xx, strict=True)]
        out.xy = [a + b for a, b in zip(self.xy, other.xy, strict=True)]
        return out

    def scale(self, f: float) -> None:
        self.xx = [[a * f for a in row] for row in self.xx]
        self.xy = [a * f for a in self.xy]


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
    if theta[FIXED] + theta[DECODE_SEQ] <= 0 and fallback is not None and fallback.decode_step_s(1) > 0:
        # Both decode terms pinned at zero: a busy machine's mixed steps ran faster than its prefill-only ones and
        # short prompts near zero (the schemathesis fuzz did it). A decode step is never free, and /load, TPOT and
        # slot waits divide by or add it: the previous decode terms stay, the prefill terms are refitted with them.
        held = {FIXED: fallback.fixed_s, DECODE_SEQ: fallback.decode_seq_s}
        theta = _nonnegative_fit(sums, held) or [*_as_theta(fallback)]
    return StepCost(
        theta[FIXED],
        theta[PREFILL_TOKEN],
        theta[DECODE_SEQ],
        margin,
        attn,
        prefill_step_s=theta[PREFILL_STEP],
    )


def _as_theta(cost: StepCost) -> tuple[float, float, float, float]:
    return (cost.fixed_s, cost.prefill_step_s, cost.prefill_token_s, cost.decode_seq_s)


def _nonnegative_fit(sums: _Sums, held: dict[int, float] | None = None) -> list[float] | None:
    """Least squares with every coefficient >= 0 (`held` ones fixed at their values): a negative one is noise in a
    fit without spread, so it is pinned at zero and the rest refitted (an active-set pass over four unknowns).
    The prefill-step term is dropped where the data cannot tell it from the fixed one (every step had a prefill)."""
    held = held or {}
    xx, xy = sums.xx, sums.xy
    rhs = [xy[i] - sum(xx[i][h] * v for h, v in held.items()) for i in range(N_FEATURES)]
    theta = [held.get(i, 0.0) for i in range(N_FEATURES)]
    # a feature never seen (no decodes yet, no prefill) stays at zero
    free = [i for i in range(N_FEATURES) if i not in held and xx[i][i] > 0]
    while free:
        sol = _solve([[xx[i][j] for j in free] for i in free], [rhs[i] for i in free])
        if sol is None and PREFILL_STEP in free:
            free.remove(PREFILL_STEP)
            continue
        if sol is None or any(not math.isfinite(v) for v in sol):
            return None
        if min(sol) >= 0:
            for i, v in zip(free, sol, strict=True):
                theta[i] = v
            return theta
        free.pop(min(range(len(sol)), key=lambda k: sol[k]))
    return theta if held else None


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
        self._stale = False  # observed since the last fit: refitted when read

    def observe(self, prefill_tokens: float, decodes: int, seconds: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        predicted = self._current.step_s(prefill_tokens, decodes)  # the last fit: a few steps old at most
        if predicted > 0:
            self.errors.append((seconds - predicted) / predicted)
        idle = max(0.0, now - self.last_observed - seconds)
        self.recent.scale(STEP_DECAY * math.exp(-idle / IDLE_DECAY_S))
        # one step counts at most OUTLIER_CLIP x its prediction: a fresh engine's first prefill took 350-530 ms
        # against ~30 (the grammar backend's start-up thread beside it, the KV cache's pages written first) and
        # taught the fit a 60 ms prefill premium; a machine that really got slower still moves the fit, by up to
        # that much a step
        used = min(seconds, OUTLIER_CLIP * predicted) if predicted > 0 else seconds
        self.recent.add(prefill_tokens, decodes, used, 1.0)
        self.last_observed = now
        if not prefill_tokens and decodes:
            bucket = min((b for b in BATCH_BUCKETS if b >= decodes), default=BATCH_BUCKETS[-1])
            old = self.decode_step_s.get(bucket)
            self.decode_step_s[bucket] = seconds if old is None else old + 0.2 * (seconds - old)
        self._stale = True

    def _fit(self) -> StepCost:
        return _coefficients(self.prior + self.recent, self._current, self.attn_cost_context, self.margin())

    def margin(self) -> float:
        """About the p90 of how much recent steps ran over their prediction (0 when they ran under)."""
        if len(self.errors) < 8:
            return 0.25  # few steps seen: assume a quarter
        ordered = sorted(self.errors)
        return max(0.0, ordered[int(0.9 * (len(ordered) - 1))])

    def current(self) -> StepCost:
        """The fit over every step observed so far. Refitted here, not per step: a batch-1 decode step on CPU
        spent ~1% of its time on the 4x4 solve, and decode-only steps schedule without the model."""
        if self._stale:
            self._current, self._stale = self._fit(), False
        return self._current
