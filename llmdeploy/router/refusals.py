"""What the client hears when the plan serves nothing: a 400/404 naming the cause, or a 503 that says why
neither the local engines nor the cloud can take the request now, with the Retry-After that fits the cause."""

from __future__ import annotations

from llmdeploy.openai_api.errors import OpenAIError, overloaded
from llmdeploy.policies.route import REJECT, SHED, Decision
from llmdeploy.router.requests import rejected

PIN_HEADER = "x-llmdeploy-revision"  # a request pins a revision with it (the answer names its revision in it)
LOCAL_REASONS = {
    "local_down": "no local engine is up",
    "queue_depth": "the local engines' queues are full",
}
CLOUD_REASONS = {
    "key_no_egress": "this API key may not use the cloud",
    "request_no_egress": "the request asked to stay local",
    "cloud_disabled": "the cloud is not enabled",
    "cloud_breaker_open": "the cloud is failing",
    "pinned_revision": "a pinned revision is served locally only",
}


def unserved_error(d: Decision, local_wait_s: float, cloud_cooldown_s: float) -> OpenAIError:
    """The error for a decision that is neither local nor cloud (reject, shed, a wait that ran out)."""
    if d.action == REJECT:
        return rejected(d.status, d.code, d.message, param=d.param or PIN_HEADER)
    why = LOCAL_REASONS.get(d.overflow_reason or "", "the local engines cannot take it")
    if d.action == SHED:
        why = f"the local engines' predicted wait is over routing.local_wait_s ({local_wait_s:g} s)"
    cloud = CLOUD_REASONS.get(d.egress_denied or "", "")
    message = f"The request cannot be served now: {why}" + (f" and {cloud}." if cloud else ".")
    retry = cloud_cooldown_s if d.egress_denied == "cloud_breaker_open" else 1.0
    return overloaded(message, d.retry_after_s if d.action == SHED else retry)
