"""Automatic rollback: judge the candidate revision's sliding window against rollout.auto_rollback.

Pure: the daemon reads Router.revision_window(candidate) about once a second and acts on the decision.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from llmdeploy.policies.snapshot import WindowStats
from llmdeploy.spec.models import AutoRollbackSpec


@dataclass(frozen=True)
class RollbackDecision:
    rollback: bool
    reason: str
    requests: int
    errors: int
    error_rate: float
    ttft_p99_ms: float | None
    window_s: float
    max_error_rate: float
    max_ttft_p99_ms: float
    min_requests: int

    def numbers(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("rollback", "reason")}


def judge_candidate(stats: WindowStats, limits: AutoRollbackSpec) -> RollbackDecision:
    def decide(rollback: bool, reason: str) -> RollbackDecision:
        return RollbackDecision(
            rollback,
            reason,
            stats.requests,
            stats.errors,
            stats.error_rate,
            stats.ttft_p99_ms,
            stats.window_s,
            limits.max_error_rate,
            limits.max_ttft_p99_ms,
            limits.min_requests,
        )

    if not limits.enabled:
        return decide(False, "auto-rollback is disabled")
    window = f"over {stats.requests} requests in the last {stats.window_s:g}s"
    if stats.requests < limits.min_requests:
        return decide(False, f"{stats.requests} of {limits.min_requests} requests needed to judge")
    if stats.error_rate > limits.max_error_rate:
        return decide(
            True, f"error rate {stats.error_rate:.1%} > max_error_rate {limits.max_error_rate:.1%} {window}"
        )
    if stats.ttft_p99_ms is not None and stats.ttft_p99_ms > limits.max_ttft_p99_ms:
        return decide(
            True,
            f"TTFT p99 {stats.ttft_p99_ms:.1f} ms > max_ttft_p99_ms {limits.max_ttft_p99_ms:g} ms {window}",
        )
    return decide(False, f"within limits {window}")
