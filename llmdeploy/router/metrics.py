"""Prometheus metrics of the router, in its own registry, all named `llmdeploy_router_*`.

Labels carry key names, backends and revisions, never a key or any request text.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmdeploy.engine.resources import host_memory

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
# (metric name after llmdeploy_router_engine_, ResourceUsage field, help): what each engine's /load reports
ENGINE_RESOURCES = (
    ("rss_bytes", "rss_bytes", "Engine process resident memory"),
    ("peak_rss_bytes", "peak_rss_bytes", "Engine process peak resident memory since it started"),
    ("device_memory_bytes", "device_memory_bytes", "GPU memory the engine holds (CUDA only)"),
    ("device_peak_memory_bytes", "device_peak_memory_bytes", "Peak GPU memory the engine held (CUDA only)"),
    (
        "device_memory_total_bytes",
        "device_memory_total_bytes",
        "GPU memory of the engine's device (CUDA only)",
    ),
    ("gpu_utilization_perc", "gpu_utilization", "GPU utilisation, 0..1 (CUDA with nvidia-ml-py only)"),
)


class _Family:
    """Makes the router's metrics: the prefix and the registry written once."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.registry, self.prefix = registry, prefix

    def counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(f"{self.prefix}{name}", doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(f"{self.prefix}{name}", doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
        return Histogram(f"{self.prefix}{name}", doc, labels, buckets=buckets, registry=self.registry)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        f = _Family(self.registry, "llmdeploy_router_")
        self.requests = f.counter("requests", "Requests answered", "backend", "revision", "status")
        self.key_requests = f.counter("key_requests", "Requests per API key name", "key", "status")
        self.errors = f.counter("errors", "Error answers to clients, by error code", "type")
        self.upstream_errors = f.counter(
            "upstream_errors", "Failed attempts at a backend, by kind", "backend", "type"
        )
        self.overflow = f.counter(
            "overflow", "Requests sent to the cloud instead of local, by reason", "reason"
        )
        self.failovers = f.counter(
            "failovers", "Reroutes before the commit point", "from_backend", "to_backend"
        )
        self.retries = f.counter("retries", "Cloud retries before the commit point", "kind")
        self.capability_decisions = f.counter(
            "capability_decisions",
            "Requests by which backends could serve them (none: no special needs; any; local_only; "
            "cloud_only; rejected)",
            "decision",
        )
        latency = ("backend", "revision")
        self.ttft = f.histogram("ttft_seconds", "Time to first token (streams)", LATENCY_BUCKETS, *latency)
        self.e2e = f.histogram(
            "e2e_seconds", "Request latency, arrival to last byte", LATENCY_BUCKETS, *latency
        )
        self.cloud_tokens = f.counter(
            "cloud_tokens", "Tokens sent to / received from the cloud (cost)", "direction"
        )
        self.inflight = f.gauge("inflight_requests", "Requests in flight (arrived, not yet answered)")
        self.breaker_open = f.gauge(
            "breaker_open", "1 while a backend's circuit breaker is not closed", "backend"
        )

        # the engines as the router last polled them (/load): so one scrape of the router shows the whole host
        engine = ("revision", "replica")
        self.engine_kv = f.gauge("engine_kv_cache_usage_perc", "Engine KV cache usage, 0..1", *engine)
        self.engine_waiting = f.gauge("engine_requests_waiting", "Engine requests waiting", *engine)
        self.engine_running = f.gauge("engine_requests_running", "Engine requests running", *engine)
        self.engine_up = f.gauge("engine_up", "1 while the engine answers /load and is ready", *engine)

        # tokens and money (llmdeploy/policies/cost.py), the split, the control plane's events, resources
        self.tokens = f.counter(
            "tokens",
            "Tokens served, by backend and direction (in: prompt, out: completion)",
            "backend",
            "direction",
        )
        self.key_tokens = f.counter("key_tokens", "Tokens per API key name and direction", "key", "direction")
        self.cloud_cost = f.counter(
            "cloud_cost", "Money spent at the cloud at the spec's cost: prices", "currency"
        )
        self.tpot = f.histogram(
            "tpot_seconds",
            "Time per output token after the first (answers of 2+ tokens with a TTFT)",
            TPOT_BUCKETS,
            *latency,
        )
        self.traffic_percent = f.gauge(
            "traffic_percent",
            "Share of traffic each listed revision takes (the canary split), 0..100",
            "revision",
            "role",
        )
        self.rollbacks = f.counter(
            "rollbacks",
            "Candidate rollbacks and re-deploys of an earlier revision (manual or auto)",
            "trigger",
        )
        self.engine_restarts = f.counter(
            "engine_restarts", "Engine crashes the supervisor restarts, by revision", "revision"
        )
        self.control_events = f.counter(
            "control_events",
            "Control-plane events (apply, canary, promote, rollback, engine-crash...)",
            "kind",
        )
        for trigger in ("manual", "auto"):
            self.rollbacks.labels(trigger)
        for backend in ("local", "cloud"):
            for direction in ("in", "out"):
                self.tokens.labels(backend, direction)
        self.engine_resources = {
            attr: f.gauge(f"engine_{name}", doc, *engine) for name, attr, doc in ENGINE_RESOURCES
        }
        self.host_memory = f.gauge(
            "host_memory_bytes", "Memory of the machine (total, available), as the router reads it", "kind"
        )

    def set_engine_resources(self, rows: list[tuple[str, str, object]]) -> None:
        """(revision, replica, ResourceUsage | None) for every listed engine; engines no longer listed vanish."""
        for gauge in self.engine_resources.values():
            gauge.clear()
        for revision, replica, usage in rows:
            if usage is None:
                continue
            for attr, gauge in self.engine_resources.items():
                value = getattr(usage, attr)
                if value is not None:
                    gauge.labels(revision, replica).set(value)
        total, available = host_memory()
        if total:
            self.host_memory.labels("total").set(total)
        if available is not None:
            self.host_memory.labels("available").set(available)

    def set_split(self, routes: list[tuple[str, str, float]]) -> None:
        """(revision, role, percent) of the routing table now."""
        self.traffic_percent.clear()
        for revision, role, percent in routes:
            self.traffic_percent.labels(revision, role).set(percent)

    def render(self) -> bytes:
        return generate_latest(self.registry)
