"""Capability-aware routing, decided without a server: needs read from requests, backends' declarations,
and the gate's verdict with route.decide."""

from __future__ import annotations

import pytest

from llmdeploy.openai_api.schemas import ChatCompletionRequest, CompletionRequest
from llmdeploy.policies import capability as cap
from llmdeploy.policies.egress import CloudState
from llmdeploy.policies.overflow import OverflowLimits
from llmdeploy.policies.route import CLOUD, LOCAL, REJECT, decide
from llmdeploy.policies.snapshot import EngineLoad, ReplicaState, RequestFacts, RevisionState

LOCAL_CAPS = {
    "features": [
        "tools",
        "json_object",
        "json_schema",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "logit_bias",
        "logprobs",
        "best_of",
    ],
    "max_model_len": 2048,
    "max_logprobs": 20,
}
CLOUD_CAPS = cap.Capabilities.for_cloud("qianfan", None, 128_000)
LIMITS = OverflowLimits(ttft_p99_ms=1000, max_queue_depth=8)
UP = CloudState(True, True)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def revisions(caps: dict | None = LOCAL_CAPS) -> list[RevisionState]:
    load = EngineLoad.from_json(
        {"free_blocks": 1000, "total_blocks": 1024, "max_num_seqs": 8, "capabilities": caps}
    )
    return [RevisionState(1, "stable", 0.0, (ReplicaState("http://e", "r0", 1, load),))]


def facts(req, allow_cloud: bool = True, pinned: int | None = None) -> RequestFacts:
    needs = cap.needs_of(req, 10)
    return RequestFacts(
        prompt_tokens=10, max_tokens=16, key_allows_cloud=allow_cloud, pinned_revision=pinned, needs=needs
    )


def route(req, revs=None, cloud=UP, cloud_caps=CLOUD_CAPS, **kw):
    revs = revisions() if revs is None else revs
    f = facts(req, **kw)
    g = cap.gate(revs, f, cloud, cloud_caps)
    return g, decide(revs, f, LIMITS, cloud, gate=g)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
IMAGE = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is it?"},
            {"type": "image_url", "image_url": {"url": "https://x/a.png"}},
        ],
    }
]


def test_needs_are_read_from_the_fields():
    req = chat(
        tools=[TOOL],
        response_format={"type": "json_object"},
        logit_bias={"5": 1},
        logprobs=True,
        top_logprobs=3,
    )
    needs = cap.needs_of(req, 7)
    assert dict(needs.features) == {
        "tools": "tools",
        "json_object": "response_format",
        "logit_bias": "logit_bias",
        "logprobs": "logprobs",
    }
    assert needs.top_logprobs == 3 and needs.context_tokens == 7
    comp = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "echo": True, "logprobs": 2, "max_tokens": 5, "n": 1, "best_of": 3}
    )
    assert dict(cap.needs_of(comp, 4).features) == {"echo_logprobs": "echo", "best_of": "best_of"}
    assert not cap.needs_of(chat(tools=[TOOL], tool_choice="none"), 1).special


def test_plain_and_shared_needs_route_as_usual():
    g, d = route(chat())
    assert g.label == "none" and d.action == LOCAL and d.plan[-1].backend == CLOUD
    g, d = route(chat(tools=[TOOL], tool_choice="required"))
    assert g.label == "any" and d.action == LOCAL and d.plan[-1].backend == CLOUD


def test_local_only_feature_keeps_the_cloud_out_of_the_plan():
    g, d = route(chat(logit_bias={"5": 3}))
    assert g.label == "local_only" and d.action == LOCAL
    assert all(t.backend == LOCAL for t in d.plan)


@pytest.mark.parametrize(
    "req, param",
    [
        (chat(messages=IMAGE), "messages"),
        (
            CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": True, "logprobs": 1}),
            "echo",
        ),
    ],
)
def test_what_only_the_cloud_has_goes_to_the_cloud_or_is_a_400(req, param):
    g, d = route(req, cloud_caps=cap.Capabilities.for_cloud("openai-compatible", None, None))
    assert g.label == "cloud_only" and d.action == CLOUD and d.plan[0].backend == CLOUD
    assert d.overflow_reason == cap.OVERFLOW_REASON
    g, d = route(
        req, allow_cloud=False, cloud_caps=cap.Capabilities.for_cloud("openai-compatible", None, None)
    )
    assert g.label == "rejected" and d.action == REJECT and d.status == 400 and d.param == param
    assert "may not be sent to the cloud" in d.message
    g, d = route(req, pinned=1, cloud_caps=cap.Capabilities.for_cloud("openai-compatible", None, None))
    assert d.action == REJECT and d.param == param


def test_nobody_can_serve_it():
    req = chat(messages=IMAGE, logit_bias={"1": 2})
    g, d = route(req)
    assert d.action == REJECT and d.param == "messages" and "No backend" in d.message
    g, d = route(chat(messages=IMAGE), cloud=CloudState(False, True))
    assert d.action == REJECT and d.param == "messages"


def test_cloud_features_follow_the_yaml_and_provider_defaults():
    assert "logprobs" not in cap.Capabilities.for_cloud("qianfan", None, None).features
    assert "logprobs" in cap.Capabilities.for_cloud("openai-compatible", None, None).features
    only_json = cap.Capabilities.for_cloud("qianfan", ["json_object"], None)
    g, d = route(chat(tools=[TOOL]), cloud_caps=only_json)
    assert g.label == "local_only" and all(t.backend == LOCAL for t in d.plan)


def test_an_engine_without_capabilities_is_not_judged():
    g, d = route(chat(messages=IMAGE), revs=revisions(caps=None))
    assert g.label == "any" and d.action == LOCAL


def test_top_logprobs_over_the_local_limit():
    small = {**LOCAL_CAPS, "max_logprobs": 2}
    g, d = route(
        chat(logprobs=True, top_logprobs=5),
        revs=revisions(small),
        cloud_caps=cap.Capabilities.for_cloud("openai-compatible", None, None),
    )
    assert g.label == "cloud_only" and d.action == CLOUD


def test_capabilities_json_round_trip_and_junk():
    c = cap.Capabilities.from_json(LOCAL_CAPS)
    assert cap.Capabilities.from_json(c.to_json()) == c
    assert cap.Capabilities.from_json({"features": "tools"}) is None
    assert cap.Capabilities.from_json({"features": [], "max_model_len": "x"}) is None
    assert EngineLoad.from_json({"capabilities": 5}).capabilities is None


def test_a_long_context_without_egress_is_left_to_the_engine():
    """The router's count is an estimate: the engine, which counts exactly, answers for itself."""
    openai_like = cap.Capabilities.for_cloud("openai-compatible", None, None)
    g, d = route(chat(max_tokens=4096), cloud_caps=openai_like)
    assert g.label == "cloud_only" and d.action == CLOUD
    g, d = route(chat(max_tokens=4096), allow_cloud=False, cloud_caps=openai_like)
    assert g.label == "local_only" and d.action == LOCAL and all(t.backend == LOCAL for t in d.plan)
