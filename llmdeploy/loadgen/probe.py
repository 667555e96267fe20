"""Samples the server's Prometheus /metrics while a level runs: the engine's KV usage and queue, the router's
requests in flight. Names are llmdeploy's (engine/metrics.py, router/metrics.py) and vLLM's, so the same probe
reads what a user runs today. A URL that answers with an error or without any of these names is reported as
absent, with the reason, and not polled again: bench never fails for want of metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# figure -> (metric names, how several samples combine: one engine per model label, replicas add up)
GAUGES: dict[str, tuple[tuple[str, ...], str]] = {
    "kv_usage": (
        ("llmdeploy:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "max",
    ),
    "waiting": (("llmdeploy:num_requests_waiting", "vllm:num_requests_waiting"), "sum"),
    "running": (("llmdeploy:num_requests_running", "vllm:num_requests_running"), "sum"),
    "router_inflight": (("llmdeploy_router_inflight_requests",), "sum"),
}


# what an llmdeploy router reports of its engines (from their /load): used only where no engine is scraped itself,
# so that scraping the router and its engines together does not count the engines twice
VIA_ROUTER: dict[str, str] = {
    "kv_usage": "llmdeploy_router_engine_kv_cache_usage_perc",
    "waiting": "llmdeploy_router_engine_requests_waiting",
    "running": "llmdeploy_router_engine_requests_running",
}


def read_gauges(text: str) -> dict[str, float]:
    """The figures present in one exposition (absent ones left out); ValueError when it is not Prometheus text.
    Figures the router reports of its engines come back under 'via_router:<figure>'."""
    found: dict[str, list[float]] = {}
    routed = {name: figure for figure, name in VIA_ROUTER.items()}
    for family in text_string_to_metric_families(text):
        values = [s.value for s in family.samples if s.name == family.name]
        for figure, (names, _) in GAUGES.items():
            if family.name in names:
                found.setdefault(figure, []).extend(values)
        if family.name in routed:
            found.setdefault(f"via_router:{routed[family.name]}", []).extend(values)
    return {f: (max(v) if _how(f) == "max" else sum(v)) for f, v in found.items() if v}


def _how(figure: str) -> str:
    return GAUGES[figure.removeprefix("via_router:")][1]


def combine(readings: list[dict[str, float]]) -> dict[str, float]:
    """One moment across several /metrics URLs (the router and its engines): KV as the fullest, counts summed;
    the router's view of its engines only for figures no engine gave directly."""
    out = _combine([{k: v for k, v in r.items() if not k.startswith("via_router:")} for r in readings])
    routed = _combine(
        [
            {k.removeprefix("via_router:"): v for k, v in r.items() if k.startswith("via_router:")}
            for r in readings
        ]
    )
    return {**routed, **out}


def _combine(readings: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for reading in readings:
        for figure, v in reading.items():
            how = GAUGES[figure][1]
            out[figure] = (
                v if figure not in out else (max(out[figure], v) if how == "max" else out[figure] + v)
            )
    return out


def summarize(
    samples: list[dict[str, float]], sources: list[str], absent: dict[str, str]
) -> dict[str, Any] | None:
    """Mean and max of each figure over the level; None when no URL gave metrics."""
    if not sources:
        return None
    figures: dict[str, Any] = {}
    for figure in GAUGES:
        values = [s[figure] for s in samples if figure in s]
        figures[figure] = {"mean": sum(values) / len(values), "max": max(values)} if values else None
    return {"sources": sources, "samples": len(samples), **figures, "absent": absent}


class MetricsProbe:
    def __init__(
        self,
        urls: list[str],
        headers: dict[str, str],
        interval_s: float = 0.5,
        verify: bool | ssl.SSLContext = True,
    ):
        self.urls, self.interval_s = urls, interval_s
        self.sources: list[str] = []
        self.absent: dict[str, str] = {}
        self._client = httpx.AsyncClient(headers=headers, timeout=5.0, verify=verify)

    async def discover(self) -> None:
        """Scrape each URL once; keep those that expose at least one known figure."""
        for url in self.urls:
            try:
                r = await self._client.get(url)
                if r.status_code != 200:
                    self.absent[url] = f"HTTP {r.status_code}"
                elif not read_gauges(r.text):
                    self.absent[url] = "no KV/queue metrics in the answer"
                else:
                    self.sources.append(url)
            except httpx.HTTPError as e:
                self.absent[url] = f"unreachable ({type(e).__name__})"
            except ValueError:
                self.absent[url] = "not Prometheus text"

    async def sample_once(self) -> dict[str, float] | None:
        readings = []
        for url in self.sources:
            try:
                r = await self._client.get(url)
                if r.status_code == 200:
                    readings.append(read_gauges(r.text))
            except (httpx.HTTPError, ValueError):
                continue  # a missed sample under load is no reason to stop the level
        return combine(readings) if readings else None

    async def sample_until(self, stop: asyncio.Event) -> list[dict[str, float]]:
        samples: list[dict[str, float]] = []
        while self.sources and not stop.is_set():
            s = await self.sample_once()
            if s is not None:
                samples.append(s)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
        return samples

    def summary(self, samples: list[dict[str, float]]) -> dict[str, Any] | None:
        return summarize(samples, self.sources, self.absent)

    async def aclose(self) -> None:
        await self._client.aclose()
