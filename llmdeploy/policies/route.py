"""Where does one request go? DESIGN rule 2 as one pure function over a snapshot:
pinned revision -> sticky canary split -> local if it can meet the SLA now -> cloud if egress is allowed and
its breaker is closed -> else queue locally (soft limits) or wait, then 503 (hard limit: queue depth).

The result is a plan: the targets to try in order before the commit point (failover is the rest of it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmdeploy.policies import overflow as ov
from llmdeploy.policies.egress import CloudState, cloud_denied_reason
from llmdeploy.policies.snapshot import ReplicaState, RequestFacts, RevisionState
from llmdeploy.policies.split import choose_revision

LOCAL, CLOUD, WAIT, REJECT = "local", "cloud", "wait", "reject"


@dataclass(frozen=True)
class Target:
    backend: str  # "local" | "cloud"
    replica: ReplicaState | None = None


CLOUD_TARGET = Target(CLOUD)


@dataclass(frozen=True)
class Decision:
    action: str  # local | cloud | wait | reject
    revision: int | None = None
    plan: tuple[Target, ...] = ()
    overflow_reason: str | None = None  # why the first choice is not local
    egress_denied: str | None = None  # why the cloud may not be used (None: it may)
    status: int = 0  # for reject
    code: str = ""
    message: str = ""


def decide(
    revisions: list[RevisionState],
    facts: RequestFacts,
    limits: ov.OverflowLimits,
    cloud: CloudState,
    take_burst_token: Callable[[], bool] = lambda: True,
) -> Decision:
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

    replicas = ov.least_loaded(rev.replicas) if rev else []
    if not replicas:
        if cloud_ok:
            return Decision(CLOUD, rev_no, (CLOUD_TARGET,), ov.LOCAL_DOWN)
        return Decision(WAIT, rev_no, (), ov.LOCAL_DOWN, denied)

    reasons = [ov.overflow_reason(r, facts.prompt_tokens, facts.max_tokens, limits) for r in replicas]
    fit = next((i for i, reason in enumerate(reasons) if reason is None), None)
    if fit is not None:
        ordered = [replicas[fit], *replicas[:fit], *replicas[fit + 1 :]]
        local_plan = tuple(Target(LOCAL, r) for r in ordered)
        if not take_burst_token() and cloud_ok:
            return Decision(CLOUD, rev_no, (CLOUD_TARGET, *local_plan), ov.BURST)
        return Decision(LOCAL, rev_no, local_plan + ((CLOUD_TARGET,) if cloud_ok else ()), None, denied)

    reason = reasons[0]
    local_plan = tuple(Target(LOCAL, r) for r in replicas)
    if cloud_ok:
        return Decision(CLOUD, rev_no, (CLOUD_TARGET, *local_plan), reason)
    if reason == ov.QUEUE_DEPTH:
        return Decision(WAIT, rev_no, (), reason, denied)
    # soft limits (SLA, KV room): still served locally, only slower
    return Decision(LOCAL, rev_no, local_plan, reason, denied)
