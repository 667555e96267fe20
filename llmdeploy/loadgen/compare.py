"""`--compare BASELINE.json`: each figure of each load level against the baseline run's, on plain JSON dicts.

A figure regresses when it moved the wrong way by more than the tolerance (relative to the baseline) and, for
latencies, by more than 1 ms (a 2 ms -> 3 ms TTFT is +50% and noise). The success rate is compared in points:
it regresses when it falls by more than 1 point, whatever the tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

Better = Literal["higher", "lower"]
LATENCY_FLOOR_MS = 1.0
SUCCESS_DROP_POINTS = 0.01

# (key path in a level's JSON, label, which way is better)
FIGURES: tuple[tuple[str, str, Better], ...] = (
    ("requests_per_s", "requests/s", "higher"),
    ("output_tokens_per_s", "output tok/s", "higher"),
    ("ttft_ms.p50", "TTFT p50 ms", "lower"),
    ("ttft_ms.p90", "TTFT p90 ms", "lower"),
    ("ttft_ms.p99", "TTFT p99 ms", "lower"),
    ("tpot_ms.p50", "TPOT p50 ms", "lower"),
    ("tpot_ms.p99", "TPOT p99 ms", "lower"),
    ("e2e_ms.p50", "e2e p50 ms", "lower"),
    ("e2e_ms.p99", "e2e p99 ms", "lower"),
    ("success_rate", "success rate", "higher"),
)

Direction = Literal["better", "worse", "same", "n/a"]


@dataclass(frozen=True)
class FigureChange:
    level: str  # "concurrency 4", "rate 5/s"
    figure: str
    baseline: float | None
    current: float | None
    change: float | None  # relative (0.12 = +12%); for the success rate, in points (-0.02 = 2 points down)
    direction: Direction
    regression: bool


def _get(level: dict[str, Any], path: str) -> float | None:
    v: Any = level
    for part in path.split("."):
        v = v.get(part) if isinstance(v, dict) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def level_key(level: dict[str, Any]) -> tuple[str, float]:
    return str(level.get("mode")), float(level.get("value", 0))


def level_label(key: tuple[str, float]) -> str:
    mode, value = key
    return f"concurrency {value:g}" if mode == "concurrency" else f"rate {value:g}/s"


def judge_figure(
    path: str, better: Better, before: float | None, after: float | None, tolerance: float
) -> tuple[float | None, Direction, bool]:
    if before is None or after is None:
        return None, "n/a", False
    if path == "success_rate":
        delta = after - before
        direction: Direction = "same" if delta == 0 else ("better" if delta > 0 else "worse")
        return delta, direction, delta < -SUCCESS_DROP_POINTS
    delta = after - before
    if delta == 0:
        return 0.0, "same", False
    change = delta / abs(before) if before else None  # from 0, any move is beyond a relative tolerance
    worse = (delta < 0) if better == "higher" else (delta > 0)
    floor = LATENCY_FLOOR_MS if path.endswith(("p50", "p90", "p99")) else 0.0
    regression = worse and (change is None or abs(change) > tolerance) and abs(delta) > floor
    return change, "worse" if worse else "better", regression


@dataclass(frozen=True)
class Comparison:
    tolerance: float
    changes: list[FigureChange]
    only_in_baseline: list[str]
    only_in_current: list[str]

    @property
    def regressions(self) -> list[FigureChange]:
        return [c for c in self.changes if c.regression]

    def to_dict(self) -> dict[str, Any]:
        return {
            "tolerance": self.tolerance,
            "regressions": len(self.regressions),
            "changes": [asdict(c) for c in self.changes],
            "only_in_baseline": self.only_in_baseline,
            "only_in_current": self.only_in_current,
        }


def compare_levels(
    baseline: Sequence[dict[str, Any]], current: Sequence[dict[str, Any]], tolerance: float
) -> Comparison:
    base = {level_key(lv): lv for lv in baseline}
    now = {level_key(lv): lv for lv in current}
    changes = []
    for key in sorted(base.keys() & now.keys(), key=lambda k: (k[0], k[1])):
        for path, label, better in FIGURES:
            before, after = _get(base[key], path), _get(now[key], path)
            change, direction, regression = judge_figure(path, better, before, after, tolerance)
            changes.append(
                FigureChange(level_label(key), label, before, after, change, direction, regression)
            )
    only_base = [level_label(k) for k in sorted(base.keys() - now.keys())]
    only_now = [level_label(k) for k in sorted(now.keys() - base.keys())]
    return Comparison(tolerance, changes, only_base, only_now)
