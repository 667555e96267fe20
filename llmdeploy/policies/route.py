"""Where does one request go? The routing rule (docs/ARCHITECTURE.md §3.2) as one pure function over a
snapshot: pinned revision -> sticky canary split -> local if it can meet the SLA now -> cloud if egress is allowed and
its breaker is closed -> else queue locally (soft limits) or wait, then 503 (hard limit: queue depth).

The result is a plan: the targets to try in order before the commit point (failover is the rest of it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from llmdeploy.policies import affinity
from llmdeploy.policies import capability as cap
from llmdeploy.policies import overflow as ov
from llmdeploy.policies.egress import CloudState, cloud_denied_reason
from llmdeploy.policies.snapshot import BackendKind, ReplicaState, RequestFacts, RevisionState
from llmdeploy.policies.split import choose_revision

LOCAL, CLOUD, WAIT, REJECT, SHED = "local", "cloud", "wait", "reject", "shed"
Action = Literal["local", "cloud", "wait", "reject", "shed"]


@dataclass(frozen=True)
class Target:
    backend: BackendKind
    replica: ReplicaState | None = None


CLOUD_TARGET = Target(CLOUD)


@dataclass(frozen=True)
class Decision:
    action: Action
    revision: int | None = None
    plan: tuple[Target, ...] = ()
    overflow_reason: str | None = None  # why the first choice is not local
    egress_denied: str | None = None  # why the cloud may not be used (None: it may)
    status: int = 0  # for reject
    code: str = ""
    message: str = ""
    param: str | None = None  # for a 400: the request field no backend can honour
    capability: str = "none"  # the capability gate's label (policies/capability.py LABELS)
    retry_after_s: float = 1.0  # for shed: when the queue is predicted to have room again


def decide(
    revisions: list[RevisionState],
    facts: RequestFacts,
    limits: ov.OverflowLimits,
    cloud: CloudState,
    take_burst_token: Callable[[], bool] = lambda: True,
    gate: cap.Gate | None = None,
    replica_choice: affinity.ReplicaChoice = affinity.ReplicaChoice(),
) -> Decision:
    if gate is not None:  # capabilities first (policies/capability.py): who can serve this at all
        if gate.action == cap.REJECT:
            return Decision(
                REJECT, status=400, code="unsupported_by_backends", message=gate.message, param=gate.param
            )
        if gate.action == cap.CLOUD:
            return Decision(CLOUD, None, (CLOUD_TARGET,), cap.OVERFLOW_REASON)
        revisions, cloud = gate.revisions, gate.cloud or cloud
    sticky = facts.sticky_value or facts.key_name
    choice = choose_revision(revisions, sticky, facts.pinned_revision)
    if choice.error == "revision_not_found":
        return Decision(REJECT, status=404, code=choice.error, message=choice.message)
    if choice.error == "revision_not_ready":
        return Decision(REJECT, status=400, code=choice.error, message=choice.message)
    rev = choice.revision
    rev_no = rev.revision if rev else None
    # a pinned request asks for that revision's model: the cloud would answer with another one
    denied = "pinned_revision" if facts.pinned_revision is not None else None
    denied = denied or cloud_denied_reason(facts.key_allows_cloud, facts.header_allows_cloud, cloud)
    cloud_ok = denied is None

    # the replica likely holding the prompt's prefix first, bounded by load (policies/affinity.py)
    replicas = affinity.order(ov.least_loaded(rev.replicas), facts.prefix_key, replica_choice) if rev else []
    if not replicas:
        if cloud_ok:
            return Decision(CLOUD, rev_no, (CLOUD_TARGET,), ov.LOCAL_DOWN)
        return Decision(WAIT, rev_no, (), ov.LOCAL_DOWN, denied)

    reasons = [
        ov.overflow_reason(r, ov.prompt_tokens_on(r, facts), facts.max_tokens, limits) for r in replicas
    ]
    fit = next((i for i, reason in enumerate(reasons) if reason is None), None)
    if fit is not None:
        ordered = [replicas[fit], *replicas[:fit], *replicas[fit + 1 :]]
        local_plan = tuple(Target(LOCAL, r) for r in ordered)
        if not take_burst_token() and cloud_ok:
            return Decision(CLOUD, rev_no, (CLOUD_TARGET, *local_plan), ov.BURST)
        if not cloud_ok and (shed := _shed(replicas, facts, limits, rev_no, None, denied)):
            return shed
        return Decision(LOCAL, rev_no, local_plan + ((CLOUD_TARGET,) if cloud_ok else ()), None, denied)

    reason = reasons[0]
    local_plan = tuple(Target(LOCAL, r) for r in replicas)
    if cloud_ok:
        return Decision(CLOUD, rev_no, (CLOUD_TARGET, *local_plan), reason)
    if reason == ov.QUEUE_DEPTH:
        return Decision(WAIT, rev_no, (), reason, denied)
    if shed := _shed(replicas, facts, limits, rev_no, reason, denied):
        return shed
    # soft limits (SLA, KV room): still served locally, only slower
    return Decision(LOCAL, rev_no, local_plan, reason, denied)


def _shed(
    replicas: list[ReplicaState],
    facts: RequestFacts,
    limits: ov.OverflowLimits,
    rev_no: int | None,
    reason: str | None,
    denied: str | None,
) -> Decision | None:
    """With nowhere to spill, a request whose predicted wait on every replica is over the bound gets 503 with
    Retry-After up front rather than queueing without bound (issue 14 item 5)."""
    if limits.max_wait_ms is None:
        return None
    waits = [
        ov.predicted_ttft_ms(r.load, ov.prompt_tokens_on(r, facts), r.inflight) for r in replicas if r.load
    ]
    if not waits or min(waits) <= limits.max_wait_ms:
        return None
    retry_s = max(1.0, (min(waits) - limits.max_wait_ms) / 1e3)
    return Decision(SHED, rev_no, (), reason or ov.PREDICTED_TTFT, denied, retry_after_s=retry_s)
