"""Prometheus metrics of the router, in its own registry, all named `llmdeploy_router_*`.

Labels carry key names, backends and revisions, never a key or any request text.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


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

    def render(self) -> bytes:
        return generate_latest(self.registry)
