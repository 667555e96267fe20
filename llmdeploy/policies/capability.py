"""Can a backend give what a request asks for? Capability-aware routing as pure functions.

Each backend declares what it supports: a local engine in the `capabilities` object of its /load JSON (from
the loaded model and the engine), the cloud in the YAML (`cloud.capabilities`, else its provider's defaults).
A request's needs are read from its fields. The gate runs before the SLA rules:
- every backend can serve it: route as usual (label `any`, or `none` for a request with no special needs);
- only local can (the cloud lacks a feature, e.g. logit_bias over another tokenizer): the cloud is left out
  of the plan (`local_only`);
- only the cloud can (images, a context over max_model_len, a feature the local model lacks): the cloud,
  when egress is allowed (`cloud_only`), else a 400 naming the `param` (`rejected`);
- nobody can: a 400 naming the `param` (`rejected`), never a silent drop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from llmdeploy.policies.egress import CloudState, cloud_denied_reason

Feature = Literal[
    "tools",
    "json_object",
    "json_schema",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "logit_bias",
    "logprobs",
    "echo_logprobs",
    "best_of",
    "images",
]
ALL_FEATURES: tuple[Feature, ...] = Feature.__args__  # type: ignore[attr-defined]
# what a provider's API takes when the YAML does not say: logit_bias names another tokenizer's token ids and
# guided_regex/choice are vLLM's own, so no provider gets them; guided_json goes out as response_format
PROVIDER_DEFAULTS: dict[str, frozenset[str]] = {
    "qianfan": frozenset({"tools", "json_object", "json_schema", "guided_json", "images"}),
    "openai-compatible": frozenset(
        {
            "tools",
            "json_object",
            "json_schema",
            "guided_json",
            "logprobs",
            "echo_logprobs",
            "best_of",
            "images",
        }
    ),
}

Action = Literal["route", "cloud", "reject"]
ROUTE, CLOUD, REJECT = "route", "cloud", "reject"
Label = Literal["none", "any", "local_only", "cloud_only", "rejected"]
LABELS: tuple[str, ...] = ("none", "any", "local_only", "cloud_only", "rejected")
OVERFLOW_REASON = "capability"  # the overflow metric's reason when only the cloud can serve


@dataclass(frozen=True)
class Capabilities:
    features: frozenset[str] = frozenset(ALL_FEATURES)
    max_model_len: int | None = None  # None: not known (not judged)
    max_logprobs: int | None = None

    @classmethod
    def from_json(cls, data: Any) -> Capabilities | None:
        """The engine's /load `capabilities`; None when absent or malformed (an older engine: not judged)."""
        if not isinstance(data, dict) or not isinstance(data.get("features"), list):
            return None
        try:
            mml = data.get("max_model_len")
            mlp = data.get("max_logprobs")
            return cls(
                frozenset(str(f) for f in data["features"]),
                int(mml) if mml is not None else None,
                int(mlp) if mlp is not None else None,
            )
        except (TypeError, ValueError):
            return None

    def to_json(self) -> dict[str, Any]:
        return {
            "features": sorted(self.features),
            "max_model_len": self.max_model_len,
            "max_logprobs": self.max_logprobs,
        }

    @classmethod
    def for_cloud(
        cls, provider: str, features: Iterable[str] | None, max_model_len: int | None
    ) -> Capabilities:
        chosen = frozenset(features) if features is not None else PROVIDER_DEFAULTS.get(provider, frozenset())
        return cls(chosen, max_model_len, 20 if "logprobs" in chosen else None)


@dataclass(frozen=True)
class Needs:
    """What one request asks of a backend: feature -> the request field that asks for it."""

    features: tuple[tuple[str, str], ...] = ()
    context_tokens: int = 0  # estimated prompt tokens + the client's own output limit (0 if none set)
    context_param: str = "messages"
    top_logprobs: int = 0

    @property
    def special(self) -> bool:
        return bool(self.features)


def needs_of(req: Any, prompt_tokens: int) -> Needs:
    """The needs of a validated ChatCompletionRequest / CompletionRequest (duck-typed: no router import)."""
    found: list[tuple[str, str]] = []
    is_chat = hasattr(req, "messages")
    if is_chat:
        if getattr(req, "tool_mode", "none") != "none":
            found.append(("tools", "tools"))
        rf = getattr(req, "response_format", None)
        if rf is not None and rf.type in ("json_object", "json_schema"):
            found.append((rf.type, "response_format"))
        if any(getattr(m, "has_images", False) for m in req.messages):
            found.append(("images", "messages"))
    for name in ("guided_json", "guided_regex", "guided_choice", "logit_bias"):
        if getattr(req, name, None) is not None:
            found.append((name, name))
    top = 0
    if is_chat and req.logprobs:
        found.append(("logprobs", "logprobs"))
        top = req.top_logprobs or 0
    elif not is_chat and req.logprobs is not None:
        found.append(("echo_logprobs" if req.echo else "logprobs", "echo" if req.echo else "logprobs"))
        top = req.logprobs
    if getattr(req, "best_of", None) is not None and req.best_of > req.n:
        found.append(("best_of", "best_of"))
    limit = req.output_limit or 0
    return Needs(tuple(found), prompt_tokens + limit, "messages" if is_chat else "prompt", top)


def lacking(needs: Needs, caps: Capabilities | None) -> tuple[str, str] | None:
    """(what, param) the backend cannot give, or None when it can give everything (or is not known)."""
    if caps is None:
        return None
    for feature, param in needs.features:
        if feature not in caps.features:
            return feature, param
    if caps.max_model_len is not None and needs.context_tokens > caps.max_model_len:
        return "context", needs.context_param
    if caps.max_logprobs is not None and needs.top_logprobs > caps.max_logprobs:
        return "top_logprobs", "top_logprobs"
    return None


@dataclass(frozen=True)
class Gate:
    action: Action
    label: Label
    revisions: list = field(default_factory=list)  # for ROUTE: replicas lacking something left out
    cloud: CloudState | None = None  # for ROUTE: disabled when the cloud lacks something
    param: str | None = None  # for REJECT
    message: str = ""


def _without(revisions: list, needs: Needs) -> tuple[list, bool]:
    """Revisions with the replicas that lack something marked not ready; whether any replica is left."""
    out, any_left = [], False
    for rev in revisions:
        replicas = []
        for r in rev.replicas:
            caps = getattr(r.load, "capabilities", None) if r.load else None
            ok = lacking(needs, caps) is None
            any_left = any_left or (ok and r.usable)
            replicas.append(r if ok else replace(r, listed_ready=False))
        out.append(replace(rev, replicas=tuple(replicas)))
    return out, any_left


def _known_local_lack(revisions: list, needs: Needs) -> tuple[str, str] | None:
    for rev in revisions:
        for r in rev.replicas:
            if r.usable:
                missing = lacking(needs, getattr(r.load, "capabilities", None))
                if missing is not None:
                    return missing
    return None


def gate(revisions: list, facts: Any, cloud: CloudState, cloud_caps: Capabilities | None) -> Gate:
    needs: Needs | None = getattr(facts, "needs", None)
    if needs is None:
        return Gate(ROUTE, "none", revisions, cloud)
    local_missing = _known_local_lack(revisions, needs)
    filtered, local_ok = _without(revisions, needs) if local_missing else (revisions, True)
    cloud_missing = lacking(needs, cloud_caps)
    if local_missing is None and cloud_missing is None:
        return Gate(ROUTE, "any" if needs.special else "none", revisions, cloud)
    if local_ok:  # some local replica can; the cloud may not take part if it lacks something
        keep = cloud if cloud_missing is None else CloudState(False, cloud.breaker_allows)
        return Gate(ROUTE, "local_only" if cloud_missing else "any", filtered, keep)
    what, param = local_missing  # type: ignore[misc]
    egress_denied = "pinned_revision" if facts.pinned_revision is not None else None
    egress_denied = egress_denied or cloud_denied_reason(
        facts.key_allows_cloud, facts.header_allows_cloud, cloud
    )
    if cloud_missing is None and egress_denied in (None, "cloud_breaker_open"):
        return Gate(CLOUD, "cloud_only", filtered, cloud)
    if what == "context":
        # the router's token count is an estimate: the engine counts exactly and answers its own 400
        return Gate(ROUTE, "local_only", revisions, CloudState(False, cloud.breaker_allows))
    why = _what(what)
    if cloud_missing is None and egress_denied in ("key_no_egress", "request_no_egress", "pinned_revision"):
        message = f"The local model does not support {why}, and this request may not be sent to the cloud."
    else:
        message = f"No backend of this deployment supports {why}."
    return Gate(REJECT, "rejected", filtered, cloud, param, message)


def _what(feature: str) -> str:
    return {
        "context": "a context this long (prompt and max_tokens over the model's max_model_len)",
        "images": "image input",
        "tools": "tool calling",
        "echo_logprobs": "prompt logprobs (echo with logprobs)",
        "top_logprobs": "this many top_logprobs",
    }.get(feature, feature)
