"""Open-loop arrival times: Poisson arrivals (exponential gaps), the way independent users' requests arrive.

Arrivals are drawn up front from a seeded generator, so a run is reproducible and a slow server cannot slow the
arrivals down (a closed loop would: it waits for answers, which hides queueing, "coordinated omission").
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    name: str
    start_s: float
    end_s: float
    rate: float  # arrivals per second


@dataclass(frozen=True)
class Arrival:
    at_s: float
    phase: str


def poisson_arrivals(phases: list[Phase], rng: random.Random) -> list[Arrival]:
    """Arrivals over consecutive phases; a Poisson process is memoryless, so drawing each phase on its own is
    exact (the first gap of a phase starts at the phase's start)."""
    out: list[Arrival] = []
    for p in phases:
        t = p.start_s + rng.expovariate(p.rate)
        while t < p.end_s:
            out.append(Arrival(t, p.name))
            t += rng.expovariate(p.rate)
    return out


def poisson_count(rate: float, n: int, rng: random.Random) -> list[Arrival]:
    """Exactly n arrivals at `rate` (the first one at its exponential gap from 0)."""
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(Arrival(t, ""))
    return out


def level_arrivals(
    rate: float, duration_s: float | None, requests: int | None, rng: random.Random
) -> list[Arrival]:
    if requests is not None:
        return poisson_count(rate, requests, rng)
    assert duration_s is not None
    return poisson_arrivals([Phase("", 0.0, duration_s, rate)], rng)


def burst_phases(
    base_rate: float, factor: float, before_s: float, burst_s: float, after_s: float
) -> list[Phase]:
    return [
        Phase("before", 0.0, before_s, base_rate),
        Phase("burst", before_s, before_s + burst_s, base_rate * factor),
        Phase("after", before_s + burst_s, before_s + burst_s + after_s, base_rate),
    ]
