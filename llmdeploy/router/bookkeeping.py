"""The one writer of what requests came to: each request's Outcome goes, once, into the metrics, the revision
windows (what auto-rollback judges), the dashboard's series and cost counters, and the access log.

Nothing else in the router books a request: admission, refusals and the dispatcher only conclude Outcomes
(router/outcome.py). A stream is recorded when it ends, so its outcome is the whole answer's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from llmdeploy.policies.cost import Prices
from llmdeploy.router.access_log import AccessRecord, log_access
from llmdeploy.router.dashboard_data import Observer
from llmdeploy.router.metrics import RouterMetrics
from llmdeploy.router.outcome import Call, Outcome
from llmdeploy.router.settings import Settings
from llmdeploy.router.windows import RevisionWindows


class Bookkeeper:
    def __init__(
        self,
        metrics: RouterMetrics,
        windows: RevisionWindows,
        observer: Observer,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics, self.windows, self.observer, self.clock = metrics, windows, observer, clock

    def arrived(self) -> None:
        self.metrics.inflight.inc()

    def record(self, call: Call, o: Outcome, settings: Settings) -> None:
        """Book `call`'s outcome; a second outcome for the same call (a race at its end) is ignored."""
        if call.booked:
            return
        call.booked = True
        now = self.clock()
        self.metrics.inflight.dec()
        self._attempts(o, now)
        self._answer(call.key, o)
        self.observer.record(o, call.key, Prices.from_spec(getattr(settings.spec, "cost", None)))
        if o.served_by == "local" and o.revision is not None and o.status in (200, 499):
            ttft_ms = None if o.ttft_s is None else o.ttft_s * 1000
            self.windows.record(o.revision, o.broken is not None, ttft_ms, now)
        log_access(access_record(call, o), settings.bodies)

    def _attempts(self, o: Outcome, now: float) -> None:
        """What the attempts before the answer went through: decisions, failovers, retries, failures."""
        m = self.metrics
        if o.capability is not None:
            m.capability_decisions.labels(o.capability).inc()
        if o.overflow is not None:
            m.overflow.labels(o.overflow).inc()
        for source, target in o.failovers:
            m.failovers.labels(source, target).inc()
        for kind in o.retries:
            m.retries.labels(kind).inc()
        for f in o.failures:
            m.upstream_errors.labels(f.backend, f.kind).inc()
            if f.backend == "local" and f.fault and o.revision is not None:
                self.windows.record(o.revision, True, None, now)
        if o.broken is not None:
            m.upstream_errors.labels(o.served_by, o.broken).inc()

    def _answer(self, key: str, o: Outcome) -> None:
        m, rev, status = self.metrics, o.revision_label, str(o.status)
        m.requests.labels(o.served_by, rev, status).inc()
        m.key_requests.labels(key, status).inc()
        if o.status >= 400 and o.status != 499:
            m.errors.labels(o.error or status).inc()
        if o.served_by == "none":
            return
        m.e2e.labels(o.served_by, rev).observe(o.total_s)
        if o.ttft_s is not None:
            m.ttft.labels(o.served_by, rev).observe(o.ttft_s)
        if o.served_by == "cloud":
            m.cloud_tokens.labels("in").inc(o.prompt_tokens or 0)
            m.cloud_tokens.labels("out").inc(o.completion_tokens or 0)


# the access log's fields an Outcome holds under the same name
SAME_NAMED = (
    "prompt_tokens",
    "completion_tokens",
    "overflow",
    "attempts",
    "error",
    "capability",
    "continued",
)


def access_record(call: Call, o: Outcome) -> AccessRecord:
    return AccessRecord(
        call.request_id,
        "POST",
        f"/v1/{call.endpoint}",
        key=call.key,
        status=o.status,
        backend=o.served_by,
        revision=o.revision_label,
        replica=o.replica or "-",
        stream=call.stream,
        ttft_ms=None if o.ttft_s is None else o.ttft_s * 1000,
        e2e_ms=o.total_s * 1000,
        body=call.logged_body,
        completion=o.completion,
        **{name: getattr(o, name) for name in SAME_NAMED},
    )
