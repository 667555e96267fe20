"""The router's observability state and the dashboard's JSON document.

Observer is written by Router.finish() (one answered request: the time series, the token and cost counters) and
by the control plane (Router.control_event: the rollback/restart counters); the dashboard and `status` read it.
The router imports nothing of the control plane: the daemon installs a feed (an async callable returning its
status document: revision states, replicas, events, the saved bench curve) and the dashboard merges it in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from llmdeploy.policies.cost import DAY_S, HOUR_S, Prices, Tokens, cloud_cost, cost_report
from llmdeploy.policies.route import CLOUD, LOCAL
from llmdeploy.router.metrics import RouterMetrics
from llmdeploy.router.timeseries import TrafficSeries

log = logging.getLogger("llmdeploy.router.dashboard")
FEED_TTL_S = 1.0  # several open dashboards share one status document per second
CHART_SPAN_S = 900.0  # the charts' time axis: the last 15 minutes
ControlFeed = Callable[[], Awaitable[dict[str, Any]]]


class Observer:
    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self.series = TrafficSeries()
        self.started = time.time()
        self.control_feed: ControlFeed | None = None
        self._feed_cache: tuple[float, dict[str, Any] | None] | None = None

    # ---- writers ---------------------------------------------------------------------------------------------
    def record(
        self,
        backend: str,
        revision: int | None,
        status: int,
        error: bool,
        ttft_s: float | None,
        e2e_s: float,
        tokens: Tokens,
        key: str,
        prices: Prices,
    ) -> None:
        """One answered request. `error`: a 5xx, or a stream broken after its first byte."""
        if backend not in (LOCAL, CLOUD):
            return
        m = self.metrics
        for direction, n in (("in", tokens.input), ("out", tokens.output)):
            if n:
                m.tokens.labels(backend, direction).inc(n)
                m.key_tokens.labels(key, direction).inc(n)
        if ttft_s is not None and tokens.output > 1 and e2e_s > ttft_s:
            label = "cloud" if backend == CLOUD else str(revision)
            m.tpot.labels(backend, label).observe((e2e_s - ttft_s) / (tokens.output - 1))
        if backend == CLOUD:
            spent = cloud_cost(prices, tokens)
            if spent:
                m.cloud_cost.labels(prices.currency).inc(spent)
        ttft_ms = None if ttft_s is None else ttft_s * 1000
        self.series.record(
            time.time(), backend, revision, error or status >= 500, ttft_ms, tokens.input, tokens.output
        )

    def control_event(self, kind: str, revision: int | None) -> None:
        m = self.metrics
        m.control_events.labels(kind).inc()
        if kind in ("rollback", "auto-rollback"):
            m.rollbacks.labels("auto" if kind == "auto-rollback" else "manual").inc()
        elif kind == "engine-crash":
            m.engine_restarts.labels(str(revision)).inc()

    def refresh_gauges(self, router, now: float) -> None:
        """At scrape time: the split and each listed engine's resources, from the table and the /load poller."""
        self.metrics.set_split([(str(r.revision), r.role, r.percent) for r in router.table.revisions])
        rows = [
            (str(rev.revision), r.replica, r.load.resources if r.load is not None else None)
            for rev in router.pool.revision_states(now)
            for r in rev.replicas
        ]
        self.metrics.set_engine_resources(rows)

    # ---- readers ---------------------------------------------------------------------------------------------
    def cost(self, prices: Prices, now: float | None = None) -> dict[str, Any] | None:
        if not prices.configured:
            return None
        now = time.time() if now is None else now
        span = max(1.0, min(HOUR_S, now - self.started))
        s = self.series
        report = cost_report(
            prices,
            s.tokens(now, HOUR_S, LOCAL),
            s.tokens(now, HOUR_S, CLOUD),
            s.tokens(now, DAY_S, CLOUD),
            span,
        )
        return report.to_json()

    async def feed(self) -> dict[str, Any] | None:
        """The daemon's status document (cached FEED_TTL_S), or None for a standalone router."""
        if self.control_feed is None:
            return None
        now = time.monotonic()
        if self._feed_cache is not None and now - self._feed_cache[0] < FEED_TTL_S:
            return self._feed_cache[1]
        try:
            doc = await self.control_feed()
        except Exception:  # the dashboard keeps showing the router's own figures
            log.exception("the control plane's status feed failed")
            doc = None
        self._feed_cache = (time.monotonic(), doc)
        return doc


def dashboard_state(router, feed: dict[str, Any] | None) -> dict[str, Any]:
    """Everything the page draws, as plain JSON (no key, no request text)."""
    now = time.time()
    obs: Observer = router.observer
    snap = router.snapshot()
    feed = feed or {}
    rows = {r["id"]: r for r in feed.get("revisions", [])}
    window_s = router.windows.window_s
    revisions = []
    for r in snap["revisions"]:
        row = rows.get(r["revision"], {})
        stats = obs.series.revision_stats(now, window_s, r["revision"])
        revisions.append(
            {
                "revision": r["revision"],
                "role": r["role"],
                "percent": r["percent"],
                "ready": r["ready"],
                "state": row.get("state"),
                "model": row.get("model"),
                "window": r["window"],
                **stats,
            }
        )
    control = {(x["revision"], x["replica"]): x for x in feed.get("replicas", [])}
    replicas = []
    for r in snap["revisions"]:
        for rep in r["replicas"]:
            c = control.get((r["revision"], rep["replica"]), {})
            load = rep.get("load") or {}
            replicas.append(
                {
                    "revision": r["revision"],
                    "replica": rep["replica"],
                    "usable": rep["usable"],
                    "breaker": rep["breaker"],
                    "phase": c.get("phase"),
                    "pid": c.get("pid"),
                    "restarts": c.get("restarts"),
                    "kv_usage": load.get("kv_usage"),
                    "waiting": load.get("waiting"),
                    "running": load.get("running"),
                    "resources": rep.get("resources"),
                }
            )
    return {
        "time": now,
        "deployment": feed.get("name"),
        "alias": snap["alias"],
        "daemon": bool(feed),
        "revisions": revisions,
        "replicas": replicas,
        "traffic": {"span_s": CHART_SPAN_S, "points": obs.series.points(now, CHART_SPAN_S)},
        "share_last_hour": obs.series.share(now, HOUR_S),
        "cloud": snap["cloud"],
        "requests": snap["requests"],
        "overflow": snap["overflow"],
        "cost": snap.get("cost"),
        "bench": feed.get("bench"),
        "events": feed.get("events", [])[-12:],
        "auto_rollback": feed.get("auto_rollback"),
        "uptime_s": now - obs.started,
    }
