"""The load loops. Both are bounded: no new request after the level's duration or request count, and every
request ends by its own timeout, so a level lasts at most its duration plus one timeout.

closed loop (`--concurrency N`): N workers, each sends its next request when its previous answer ends.
open loop (`--rate R`): requests at precomputed Poisson arrival times, whether or not earlier ones have been
answered; a request's latency counts from its arrival time, so one kept waiting by the client's in-flight cap
(max_inflight) is charged the wait, as a user would be.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import httpx

from llmdeploy.loadgen.client import Target, monotonic_since, send
from llmdeploy.loadgen.probe import MetricsProbe
from llmdeploy.loadgen.results import RequestResult
from llmdeploy.loadgen.schedule import Arrival
from llmdeploy.loadgen.workload import Workload

OnResult = Callable[[RequestResult], None]


@dataclass(frozen=True)
class Stop:
    duration_s: float | None = None
    requests: int | None = None


@dataclass
class LevelRun:
    results: list[RequestResult]
    elapsed_s: float
    samples: list[dict[str, float]]


class Runner:
    def __init__(
        self,
        client: httpx.AsyncClient,
        target: Target,
        workload: Workload,
        probe: MetricsProbe | None = None,
        max_inflight: int = 1024,
    ):
        self.client, self.target, self.workload = client, target, workload
        self.probe, self.max_inflight = probe, max_inflight

    async def closed(self, concurrency: int, stop: Stop, on_result: OnResult = lambda r: None) -> LevelRun:
        clock = monotonic_since(time.perf_counter())
        results: list[RequestResult] = []
        issued = 0

        def more() -> bool:
            within_count = stop.requests is None or issued < stop.requests
            return within_count and (stop.duration_s is None or clock() < stop.duration_s)

        async def worker() -> None:
            nonlocal issued
            while more():
                issued += 1
                r = await send(self.client, self.target, self.workload.next(), clock(), clock)
                results.append(r)
                on_result(r)

        return await self._probed(asyncio.gather(*(worker() for _ in range(concurrency))), results, clock)

    async def open(self, arrivals: list[Arrival], on_result: OnResult = lambda r: None) -> LevelRun:
        clock = monotonic_since(time.perf_counter())
        results: list[RequestResult] = []
        slots = asyncio.Semaphore(self.max_inflight)

        async def one(arrival: Arrival, req) -> None:
            async with slots:
                r = await send(self.client, self.target, req, arrival.at_s, clock)
            r = replace(r, phase=arrival.phase)
            results.append(r)
            on_result(r)

        async def dispatch() -> None:
            tasks = []
            for arrival in arrivals:
                delay = arrival.at_s - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(arrival, self.workload.next())))
            await asyncio.gather(*tasks)

        return await self._probed(dispatch(), results, clock)

    async def _probed(self, load, results: list[RequestResult], clock) -> LevelRun:
        """Run the load while the probe samples /metrics; the level's span ends at its last answer."""
        stop = asyncio.Event()
        sampling = asyncio.create_task(self.probe.sample_until(stop)) if self.probe else None
        try:
            await load
        finally:
            stop.set()
            samples = await sampling if sampling else []
        elapsed = max((r.end_s for r in results), default=clock())
        return LevelRun(sorted(results, key=lambda r: r.arrival_s), elapsed, samples)
