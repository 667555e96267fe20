"""Prometheus metrics of one engine server, under `llmdeploy:` with vLLM-like names.

The names are a contract (dashboards and autoscalers key on them; tests/engine/test_server.py pins them).
Gauges and counters the engine already keeps are read from engine.stats() at scrape time by a collector, so
they can never drift from the engine; latency histograms are observed per request as it finishes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from llmdeploy.engine.outputs import EngineStats, RequestOutput

PREFIX = "llmdeploy:"
LABELS = ["model_name"]

# (metric name without prefix, EngineStats field, kind, help); counters get `_total` in the exposition
STATS_METRICS: list[tuple[str, str, str, str]] = [
    ("num_requests_running", "running", "gauge", "Requests in the running batch."),
    ("num_requests_waiting", "waiting", "gauge", "Requests waiting to be scheduled."),
    ("kv_cache_usage_perc", "kv_usage", "gauge", "KV cache usage, 0..1 (1 = all blocks in use)."),
    (
        "prefix_cache_queries",
        "prefix_cache_queries",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
    ),
    ("prefix_cache_hits", "prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache."),
    (
        "num_preemptions",
        "num_preemptions",
        "counter",
        "Sequences preempted (recomputed later) for lack of KV blocks.",
    ),
    ("prompt_tokens", "prompt_tokens_total", "counter", "Prompt tokens computed (prefill)."),
    ("generation_tokens", "generation_tokens_total", "counter", "Tokens generated."),
]

# vLLM's buckets, so dashboards built for it read these the same way; TTFT and inter-token latency share the
# steps from 0.5 s to 80 s
SECONDS_STEPS = [0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, *SECONDS_STEPS, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, *SECONDS_STEPS]
LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]


class EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        for name, attr, kind, doc in STATS_METRICS:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                PREFIX + name, doc, labels=LABELS
            )
            family.add_metric([self.model_name], float(getattr(s, attr)))
            yield family


# (metric name without prefix, ResourceUsage field, help): the process's watermarks (engine/resources.py);
# a device figure the engine cannot read (CPU, no NVML) is left out rather than reported as 0
RESOURCE_METRICS: list[tuple[str, str, str]] = [
    ("process_resident_memory_bytes", "rss_bytes", "Resident memory of the engine process."),
    (
        "process_peak_resident_memory_bytes",
        "peak_rss_bytes",
        "Peak resident memory since the engine started.",
    ),
    ("host_memory_total_bytes", "host_memory_total_bytes", "Physical memory of the machine."),
    ("device_memory_bytes", "device_memory_bytes", "GPU memory the engine holds (CUDA caching allocator)."),
    ("device_peak_memory_bytes", "device_peak_memory_bytes", "Peak GPU memory the engine held."),
    ("device_memory_total_bytes", "device_memory_total_bytes", "GPU memory of the engine's device."),
    ("gpu_utilization_perc", "gpu_utilization", "GPU utilisation, 0..1 (NVML; needs nvidia-ml-py)."),
]


class ResourceCollector(Collector):
    def __init__(self, model_name: str):
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        from llmdeploy.engine.resources import process_usage

        usage = process_usage()
        for name, attr, doc in RESOURCE_METRICS:
            value = getattr(usage, attr)
            if value is not None:
                family = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
                family.add_metric([self.model_name], float(value))
                yield family


class ServerMetrics:
    """A per-app registry (several apps in one test process must not share the global one)."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(stats, model_name))
        self.registry.register(ResourceCollector(model_name))

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=self.registry).labels(
                model_name
            )

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.success = Counter(
            PREFIX + "request_success",
            "Finished sequences by finish reason.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Follows one request's outputs. Inter-token gaps come from the engine's token timestamps, not from when the
    outputs reach the server: a consumer that falls behind gets several tokens in one output, and every token
    after the first still counts one gap."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics
        self.last_token_at: dict[int, float] = {}
        self.done = False

    def on_output(self, out: RequestOutput) -> None:
        t = out.metrics
        for c in out.outputs:
            k = len(c.delta_token_ids)
            if not k or t.first_token_time is None or t.last_token_time is None:
                continue
            prev = self.last_token_at.get(c.index)
            gaps = k if prev is not None else k - 1  # the first token starts the clock; TTFT covers it
            if gaps:
                gap = max(0.0, t.last_token_time - (prev if prev is not None else t.first_token_time)) / gaps
                for _ in range(gaps):  # tokens that arrive together share the time they took
                    self.m.itl.observe(gap)
            self.last_token_at[c.index] = t.last_token_time
        if out.finished:
            self._on_finished(out)

    def _on_finished(self, out: RequestOutput) -> None:
        self.done = True
        t = out.metrics
        end = t.finished_time or time.time()
        if t.first_token_time is not None:
            self.m.ttft.observe(max(0.0, t.first_token_time - t.arrival_time))
        if t.first_scheduled_time is not None:
            self.m.queue.observe(max(0.0, t.first_scheduled_time - t.arrival_time))
        self.m.e2e.observe(max(0.0, end - t.arrival_time))
        for c in out.outputs:
            self.m.success.labels(self.m.model_name, c.finish_reason or "abort").inc()

    def on_abort(self, n: int) -> None:
        if not self.done:
            self.done = True
            self.m.success.labels(self.m.model_name, "abort").inc(n)
