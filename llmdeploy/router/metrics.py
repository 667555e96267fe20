"""Prometheus metrics of the router, in its own registry, all named `llmdeploy_router_*`.

Labels carry key names, backends and revisions, never a key or any request text.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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


def host_memory() -> tuple[int, int | None]:
    """(total, available) bytes of this machine; available from /proc/meminfo (None elsewhere)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    try:
        with open("/proc/meminfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return total, int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total, None


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "llmdeploy_router_"
        self.requests = Counter(
            f"{p}requests", "Requests answered", ["backend", "revision", "status"], registry=r
        )
        self.key_requests = Counter(
            f"{p}key_requests", "Requests per API key name", ["key", "status"], registry=r
        )
        self.errors = Counter(f"{p}errors", "Error answers to clients, by error code", ["type"], registry=r)
        self.upstream_errors = Counter(
            f"{p}upstream_errors", "Failed attempts at a backend, by kind", ["backend", "type"], registry=r
        )
        self.overflow = Counter(
            f"{p}overflow", "Requests sent to the cloud instead of local, by reason", ["reason"], registry=r
        )
        self.failovers = Counter(
            f"{p}failovers", "Reroutes before the commit point", ["from_backend", "to_backend"], registry=r
        )
        self.retries = Counter(f"{p}retries", "Cloud retries before the commit point", ["kind"], registry=r)
        self.ttft = Histogram(
            f"{p}ttft_seconds",
            "Time to first token (streams)",
            ["backend", "revision"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{p}e2e_seconds",
            "Request latency, arrival to last byte",
            ["backend", "revision"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.cloud_tokens = Counter(
            f"{p}cloud_tokens", "Tokens sent to / received from the cloud (cost)", ["direction"], registry=r
        )
        self.inflight = Gauge(
            f"{p}inflight_requests", "Requests in flight (arrived, not yet answered)", registry=r
        )
        self.breaker_open = Gauge(
            f"{p}breaker_open", "1 while a backend's circuit breaker is not closed", ["backend"], registry=r
        )

        # the engines as the router last polled them (/load): so one scrape of the router shows the whole host
        engine = ["revision", "replica"]
        self.engine_kv = Gauge(
            f"{p}engine_kv_cache_usage_perc", "Engine KV cache usage, 0..1", engine, registry=r
        )
        self.engine_waiting = Gauge(
            f"{p}engine_requests_waiting", "Engine requests waiting", engine, registry=r
        )
        self.engine_running = Gauge(
            f"{p}engine_requests_running", "Engine requests running", engine, registry=r
        )
        self.engine_up = Gauge(
            f"{p}engine_up", "1 while the engine answers /load and is ready", engine, registry=r
        )

        # tokens and money (llmdeploy/policies/cost.py), the split, the control plane's events, resources
        self.tokens = Counter(
            f"{p}tokens",
            "Tokens served, by backend and direction (in: prompt, out: completion)",
            ["backend", "direction"],
            registry=r,
        )
        self.key_tokens = Counter(
            f"{p}key_tokens", "Tokens per API key name and direction", ["key", "direction"], registry=r
        )
        self.cloud_cost = Counter(
            f"{p}cloud_cost", "Money spent at the cloud at the spec's cost: prices", ["currency"], registry=r
        )
        self.tpot = Histogram(
            f"{p}tpot_seconds",
            "Time per output token after the first (answers of 2+ tokens with a TTFT)",
            ["backend", "revision"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.traffic_percent = Gauge(
            f"{p}traffic_percent",
            "Share of traffic each listed revision takes (the canary split), 0..100",
            ["revision", "role"],
            registry=r,
        )
        self.rollbacks = Counter(
            f"{p}rollbacks",
            "Candidate rollbacks and re-deploys of an earlier revision (manual or auto)",
            ["trigger"],
            registry=r,
        )
        self.engine_restarts = Counter(
            f"{p}engine_restarts",
            "Engine crashes the supervisor restarts, by revision",
            ["revision"],
            registry=r,
        )
        self.control_events = Counter(
            f"{p}control_events",
            "Control-plane events (apply, canary, promote, rollback, engine-crash...)",
            ["kind"],
            registry=r,
        )
        for trigger in ("manual", "auto"):
            self.rollbacks.labels(trigger)
        for backend in ("local", "cloud"):
            for direction in ("in", "out"):
                self.tokens.labels(backend, direction)
        self.engine_resources = {
            attr: Gauge(f"{p}engine_{name}", doc, engine, registry=r) for name, attr, doc in ENGINE_RESOURCES
        }
        self.host_memory = Gauge(
            f"{p}host_memory_bytes",
            "Memory of the machine (total, available), as the router reads it",
            ["kind"],
            registry=r,
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
