"""Router.snapshot(): what `llmdeploy status` shows about routing (plain dicts, no secrets): revisions with their
sliding windows, replicas with load and resources, cloud share, overflow reasons, the last hour and its cost."""

from __future__ import annotations

import time
from typing import Any

from llmdeploy.policies.cost import HOUR_S, Prices
from llmdeploy.policies.route import CLOUD, LOCAL

LOAD_FIELDS = ("waiting", "running", "free_blocks", "total_blocks", "predicted_queue_wait_ms", "kv_usage")


def _samples(counter) -> list[tuple[dict[str, str], float]]:
    return [
        (smp.labels, smp.value) for m in counter.collect() for smp in m.samples if smp.name.endswith("_total")
    ]


def _replica(router, r) -> dict[str, Any]:
    return {
        "replica": r.replica,
        "url": r.url,
        "usable": r.usable,
        "inflight": r.inflight,
        "breaker": router.pool.breaker(r.url).state,
        "load": None if r.load is None else {k: getattr(r.load, k) for k in LOAD_FIELDS},
        "resources": r.load.resources.to_json() if r.load is not None and r.load.resources else None,
    }


def build_snapshot(router, now: float) -> dict[str, Any]:
    s = router.settings
    revisions = []
    for rev in router.pool.revision_states(now):
        w = router.windows.stats(rev.revision, now)
        p50 = router.observer.series.revision_stats(time.time(), w.window_s, rev.revision)["ttft_p50_ms"]
        window = {
            "requests": w.requests,
            "errors": w.errors,
            "error_rate": w.error_rate,
            "ttft_p50_ms": p50,
            "ttft_p99_ms": w.ttft_p99_ms,
            "window_s": w.window_s,
        }
        revisions.append(
            {
                "revision": rev.revision,
                "role": rev.role,
                "percent": rev.percent,
                "ready": rev.ready,
                "window": window,
                "replicas": [_replica(router, r) for r in rev.replicas],
            }
        )
    requests = _samples(router.metrics.requests)
    served = {b: int(sum(v for lbl, v in requests if lbl.get("backend") == b)) for b in (LOCAL, CLOUD)}
    total = sum(served.values())
    return {
        "alias": s.alias,
        "revisions": revisions,
        "cloud": {
            "enabled": s.cloud.enabled,
            "provider": s.spec.cloud.provider,
            "model": s.cloud.model,
            "breaker": router.cloud_breaker.state,
            "share": served[CLOUD] / total if total else 0.0,
        },
        "requests": served,
        "overflow": {lbl["reason"]: v for lbl, v in _samples(router.metrics.overflow)},
        "last_hour": router.observer.series.share(time.time(), HOUR_S),
        "cost": router.observer.cost(Prices.from_spec(getattr(s.spec, "cost", None))),
    }
