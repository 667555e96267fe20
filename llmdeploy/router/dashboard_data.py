"""The router's observability state and the dashboard's JSON document.

Observer is written by the Bookkeeper (router/bookkeeping.py; one answered request: the time series, the token
and cost counters) and by the control plane (Router.control_event: the rollback/restart counters); the
dashboard and `status` read it.
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
from llmdeploy.router.outcome import Outcome
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
    def record(self, o: Outcome, key: str, prices: Prices) -> None:
        """One answered request (the Bookkeeper's); an error for the series is a 5xx or a broken stream."""
        backend = o.served_by
        if backend not in (LOCAL, CLOUD):
            return
        m = self.metrics
        tokens = Tokens(o.prompt_tokens or 0, o.completion_tokens or 0)
        for direction, n in (("in", tokens.input), ("out", tokens.output)):
            if n:
                m.tokens.labels(backend, direction).inc(n)
                m.key_tokens.labels(key, direction).inc(n)
        if o.ttft_s is not None and tokens.output > 1 and o.total_s > o.ttft_s:
            m.tpot.labels(backend, o.revision_label).observe((o.total_s - o.ttft_s) / (tokens.output - 1))
        if backend == CLOUD:
            spent = cloud_cost(prices, tokens)
            if spent:
                m.cloud_cost.labels(prices.currency).inc(spent)
        ttft_ms = None if o.ttft_s is None else o.ttft_s * 1000
        error = o.broken is not None or o.status >= 500
        self.series.record(time.time(), backend, o.revision, error, ttft_ms, tokens.input, tokens.output)

    def control_event(self, kind: str, revision: int | None) -> None:
        m = self.metrics
        m.control_events.labels(kind).inc()
        if kind in ("rollback", "auto-rollback"):
            m.rollbacks.labels("auto" if kind == "auto-rollback" else "manual").inc()
        elif kind == "engine-crash":
            m.engine_restarts.labels(str(revision)).inc()

    def refresh_gauges(self, router, now: float) -> None:
        """At scrape time: the breakers, the split, each listed engine's load and resources, from the table,
        the breakers and the /load poller."""
        m = self.metrics
        for url, br in list(router.pool.breakers.items()):
            m.breaker_open.labels(url).set(0 if br.state == "closed" else 1)
        m.breaker_open.labels("cloud").set(0 if router.cloud_breaker.state == "closed" else 1)
        m.set_split([(str(r.revision), r.role, r.percent) for r in router.table.revisions])
        revisions = router.pool.revision_states(now)
        for rev in revisions:
            for r in rev.replicas:
                labels = (str(rev.revision), r.replica)
                m.engine_up.labels(*labels).set(1 if r.usable else 0)
                if r.load is not None:
                    m.engine_kv.labels(*labels).set(r.load.kv_usage)
                    m.engine_waiting.labels(*labels).set(r.load.waiting)
                    m.engine_running.labels(*labels).set(r.load.running)
        rows = [
            (str(rev.revision), r.replica, r.load.resources if r.load is not None else None)
            for rev in revisions
            for r in rev.replicas
        ]
        m.set_engine_resources(rows)

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
