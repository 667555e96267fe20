"""Does a level meet the SLA, and which is the highest load that does.

A level meets it when its success rate is at least the minimum and its TTFT p99 and TPOT p99 are within the
targets that are set. A figure the client could not see (TTFT and TPOT without streaming; TPOT when every
answer had under two tokens) is not judged, and the level says so in its misses' place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmdeploy.loadgen.results import LoadPoint
from llmdeploy.loadgen.stats import LevelSummary


@dataclass(frozen=True)
class SLA:
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    min_success_rate: float = 0.99
    source: str | None = None  # the YAML file, "flags", or None when no latency target was given

    @property
    def has_latency_target(self) -> bool:
        return self.ttft_p99_ms is not None or self.tpot_p99_ms is not None


def sla_misses(level: LevelSummary, sla: SLA) -> list[str]:
    """Why the level misses the SLA; [] when it meets it."""
    if level.requests == 0 or level.success_rate is None:
        return ["no request finished in the level"]
    misses = []
    if level.success_rate < sla.min_success_rate:
        misses.append(f"success {level.success_rate:.1%} < {sla.min_success_rate:.1%}")
    for name, q, target in (
        ("TTFT", level.ttft_ms, sla.ttft_p99_ms),
        ("TPOT", level.tpot_ms, sla.tpot_p99_ms),
    ):
        if target is not None and q.p99 is not None and q.p99 > target:
            misses.append(f"{name} p99 {q.p99:.0f} ms > {target:g} ms")
    return misses


@dataclass(frozen=True)
class Verdict:
    asked: LoadPoint | None  # the highest load run (what the user asked the deployment to carry)
    asked_meets_sla: bool
    highest_passing: LoadPoint | None
    summary: str

    def to_dict(self) -> dict:
        point = lambda p: None if p is None else {"mode": p.mode, "value": p.value}  # noqa: E731
        return {
            "asked": point(self.asked),
            "asked_meets_sla": self.asked_meets_sla,
            "highest_passing": point(self.highest_passing),
            "summary": self.summary,
        }


def judge(levels: Sequence[LevelSummary], sla: SLA) -> Verdict:
    """Marks each level (meets_sla, sla_misses) and names the highest load that meets the SLA."""
    for lv in levels:
        lv.sla_misses = sla_misses(lv, sla)
        lv.meets_sla = not lv.sla_misses
    if not levels:
        return Verdict(None, False, None, "no load level was run")
    ordered = sorted(levels, key=lambda lv: lv.value)
    asked = ordered[-1]
    passing = [lv for lv in ordered if lv.meets_sla]
    best = passing[-1].point if passing else None
    what = (
        "the SLA"
        if sla.has_latency_target
        else f"a {sla.min_success_rate:.0%} success rate (no latency target)"
    )
    if asked.meets_sla:
        summary = f"{asked.point.label} meets {what}"
    elif best is None:
        summary = f"no level meets {what}; {asked.point.label}: {'; '.join(asked.sla_misses)}"
    else:
        summary = f"{asked.point.label} misses {what} ({'; '.join(asked.sla_misses)}); highest that meets it: {best.label}"
    return Verdict(asked.point, bool(asked.meets_sla), best, summary)
