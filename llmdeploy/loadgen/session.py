"""One bench run: preflight and warm-up, each load level with its progress bar, the verdict, the burst drill."""

from __future__ import annotations

import asyncio
import random
import ssl
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from llmdeploy.loadgen import burst as drill
from llmdeploy.loadgen.client import Target, monotonic_since, send
from llmdeploy.loadgen.parse import BurstPlan
from llmdeploy.loadgen.probe import MetricsProbe
from llmdeploy.loadgen.results import LoadMode, LoadPoint, RequestResult
from llmdeploy.loadgen.runner import LevelRun, Runner, Stop
from llmdeploy.loadgen.schedule import burst_phases, level_arrivals, poisson_arrivals
from llmdeploy.loadgen.stats import LevelSummary, summarize
from llmdeploy.loadgen.verdict import SLA, Verdict, judge
from llmdeploy.loadgen.workload import PlannedRequest, Workload


class BenchError(Exception):
    """The run cannot go on (server unreachable, every preflight refused); exit code 1."""


@dataclass
class BenchConfig:
    url: str  # as given, for the report (credentials never sit in it: the key travels in a header)
    target: Target
    metrics_urls: list[str]
    mode: LoadMode
    levels: list[float]
    stop: Stop
    workload: Workload
    sla: SLA
    burst: BurstPlan | None = None
    warmup: int = 2
    seed: int = 0
    max_inflight: int = 1024
    ca_file: str | None = None  # CA bundle for an https URL whose certificate the system does not trust

    def load_dict(self) -> dict[str, Any]:
        """What `--compare` needs to run the same load again."""
        t = self.target
        return {
            "mode": self.mode,
            "levels": self.levels,
            "duration_s": self.stop.duration_s,
            "requests": self.stop.requests,
            "prompts": self.workload.describe(),
            "stream": t.stream,
            "ignore_eos": t.ignore_eos,
            "timeout_s": t.timeout_s,
            "warmup": self.warmup,
            "seed": self.seed,
            "max_inflight": self.max_inflight,
        }


@dataclass
class BenchRun:
    levels: list[LevelSummary]
    verdict: Verdict
    burst: dict[str, Any] | None
    metrics: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[counts]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


@asynccontextmanager
async def _bar(progress: Progress, label: str, total: float, by_time: bool):
    """A bar for one level: by answers (request count) or by the clock (duration); yields on_result."""
    task = progress.add_task(label, total=total, counts="")
    done = {"ok": 0, "err": 0}
    start = time.perf_counter()

    def on_result(r: RequestResult) -> None:
        done["ok" if r.ok else "err"] += 1
        progress.update(task, counts=f"{done['ok']} ok {done['err']} err", advance=0 if by_time else 1)

    async def tick() -> None:
        while True:
            progress.update(task, completed=min(total, time.perf_counter() - start))
            await asyncio.sleep(0.2)

    ticker = asyncio.create_task(tick()) if by_time else None
    try:
        yield on_result
    finally:
        if ticker:
            ticker.cancel()
        progress.update(task, completed=total)


class Session:
    def __init__(self, cfg: BenchConfig, console: Console):
        self.cfg, self.console = cfg, console
        self.notes: list[str] = []

    async def run(self) -> BenchRun:
        cfg = self.cfg
        cap = max(cfg.max_inflight, int(max(cfg.levels)) if cfg.mode == "concurrency" else 0) + 8
        limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
        verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=cfg.ca_file) if cfg.ca_file else True
        )
        timeout = httpx.Timeout(cfg.target.timeout_s, connect=10)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, verify=verify) as client:
            await self._preflight(client)
            probe = MetricsProbe(cfg.metrics_urls, cfg.target.headers, verify=verify)
            await probe.discover()
            runner = Runner(client, cfg.target, cfg.workload, probe, cfg.max_inflight)
            try:
                levels = []
                with _progress(self.console) as progress:
                    for value in cfg.levels:
                        point = LoadPoint(cfg.mode, value)
                        run = await self._level(runner, progress, point)
                        summary = summarize(point, run.results, run.elapsed_s)
                        summary.server = probe.summary(run.samples)
                        levels.append(summary)
                verdict = judge(levels, cfg.sla)
                burst = await self._burst(runner, levels) if cfg.burst else None
            finally:
                await probe.aclose()
        metrics = {"urls": cfg.metrics_urls, "sources": probe.sources, "absent": probe.absent}
        return BenchRun(levels, verdict, burst, metrics, self.notes)

    async def _preflight(self, client: httpx.AsyncClient) -> None:
        """One short request, then the warm-up ones (not counted): a server that cannot answer stops the run
        here with its error, instead of filling every level with it."""
        clock = monotonic_since(time.perf_counter())
        first = self.cfg.workload.next()
        r = await send(client, self.cfg.target, PlannedRequest(first.messages, 1, first.kind), 0.0, clock)
        if not r.ok:
            raise BenchError(f"the first request to {self.cfg.target.chat_url} failed: {r.error}{_hint(r)}")
        for _ in range(self.cfg.warmup):
            await send(client, self.cfg.target, self.cfg.workload.next(), clock(), clock)

    async def _level(self, runner: Runner, progress: Progress, point: LoadPoint) -> LevelRun:
        stop, by_time = self.cfg.stop, self.cfg.stop.requests is None
        total = stop.duration_s if by_time else stop.requests
        async with _bar(progress, point.label, float(total or 1), by_time) as on_result:
            if point.mode == "concurrency":
                return await runner.closed(int(point.value), stop, on_result)
            rng = random.Random(f"{self.cfg.seed}:{point.value}")
            arrivals = level_arrivals(point.value, stop.duration_s, stop.requests, rng)
            return await runner.open(arrivals, on_result)

    async def _burst(self, runner: Runner, levels: list[LevelSummary]) -> dict[str, Any] | None:
        plan, sla = self.cfg.burst, self.cfg.sla
        assert plan is not None and sla.ttft_p99_ms is not None
        base = drill.sustainable_rate(levels) or drill.fallback_rate(levels)
        if base is None:
            self.notes.append("burst drill skipped: no level produced a rate to start from")
            return None
        phases = burst_phases(base.rate, plan.factor, plan.before_s, plan.duration_s, plan.after_s)
        arrivals = poisson_arrivals(phases, random.Random(f"{self.cfg.seed}:burst"))
        total = phases[-1].end_s
        with _progress(self.console) as progress:
            label = f"burst {plan.factor:g}x {base.rate * plan.factor:.3g}/s"
            async with _bar(progress, label, total, by_time=True) as on_result:
                run = await runner.open(arrivals, on_result)
        return burst_report(
            run.results, base, plan, sla.ttft_p99_ms, phases[1].start_s, phases[1].end_s, total
        )


def burst_report(
    results: list[RequestResult],
    base: drill.BaseRate,
    plan: BurstPlan,
    ttft_target_ms: float,
    burst_start_s: float,
    burst_end_s: float,
    watch_end_s: float,
) -> dict[str, Any]:
    window = min(drill.rolling_window_s(base.rate), plan.after_s)
    by_phase = {p: [r for r in results if r.phase == p] for p in ("before", "burst", "after")}
    expected = base.rate * plan.duration_s
    recovery = drill.recovery_time(results, burst_end_s, watch_end_s, ttft_target_ms, window)
    return {
        "factor": plan.factor,
        "duration_s": plan.duration_s,
        "before_s": plan.before_s,
        "after_s": plan.after_s,
        "base_rate": base.rate,
        "base_rate_reason": base.reason,
        "burst_rate": base.rate * plan.factor,
        "burst_start_s": burst_start_s,
        "burst_end_s": burst_end_s,
        "ttft_target_ms": ttft_target_ms,
        "arrivals": {p: len(rs) for p, rs in by_phase.items()},
        "expected_at_base_rate": expected,
        "excess": len(by_phase["burst"]) - expected,
        "outcomes": {p: drill.count_outcomes(rs, ttft_target_ms) for p, rs in by_phase.items()},
        "rejected_by_status": {p: _statuses(rs) for p, rs in by_phase.items()},
        "recovery_s": recovery,
        "recovered": recovery is not None,
        "rolling_window_s": window,
        "timeline": [
            [
                round(r.arrival_s, 4),
                None if r.ttft_s is None else round(r.ttft_s * 1000, 2),
                r.backend,
                r.ok,
                r.phase,
            ]
            for r in results
        ],
    }


def _statuses(results: list[RequestResult]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        if r.rejected:
            out[str(r.status)] = out.get(str(r.status), 0) + 1
    return out


def _hint(r: RequestResult) -> str:
    if r.status in (401, 403):
        return " (check the API key: --api-key-env VAR names the variable that holds it)"
    if r.status == 404:
        return " (check --model and --url: the server does not know that model or path)"
    if r.error == "connection":
        return " (is the server running at that address?)"
    return ""


def run_session(cfg: BenchConfig, console: Console) -> BenchRun:
    return asyncio.run(Session(cfg, console).run())
