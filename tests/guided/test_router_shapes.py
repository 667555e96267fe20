"""One shape from either backend: the same tool-calling and JSON-schema requests served by the local engine
(a real tiny model behind the router) and forced to the cloud (the fake cloud answering in each provider
dialect), compared field by field through the openai SDK. Plus capability routing end to end."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.engine.test_server import start_engine
from tests.router.conftest import ALIAS, CLIENT_KEY, LOCAL_ONLY_KEY, cloud_url, make_spec, wait_until

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
MSG = [{"role": "user", "content": "Weather in Paris?"}]
REQUESTS = {
    "named": dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    "required": dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
    "schema": dict(
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": CITY, "strict": True}}
    ),
}


LOCAL_ANSWERS: dict[str, object] = {}


@pytest.fixture(scope="module")
def local_engine(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("shapes-engine") / "engine.log"
    proc, url = start_engine(tiny_llama, log, "--max-model-len", "1024", "--served-alias", ALIAS)
    yield url
    proc.stop()


def sdk(rs, key: str = CLIENT_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{rs.url}/v1", api_key=key, max_retries=0, timeout=120)


def routers(fakes, start_router, local_engine):
    cloud, _ = fakes
    # no SLA overflow: the loaded test machine must not send the local half of a comparison to the cloud
    spec = make_spec(
        cloud_url(cloud),
        sla={"ttft_p99_ms": 600_000, "tpot_p99_ms": 600_000},
        routing={"overflow": {"use_predicted_ttft": False}},
    )
    local = start_router(spec, [local_engine])
    assert wait_until(
        lambda: local.router.pool.load_of(local_engine, __import__("time").monotonic()) is not None, 30
    )
    only_cloud = start_router(spec, [])  # no local engine: everything goes to the cloud
    return cloud, local, only_cloud


def shape(resp) -> dict:
    """The OpenAI fields a client reads, with values where they must agree and types where they may not."""
    c = resp.choices[0]
    calls = [
        (t.type, t.function.name, json.loads(t.function.arguments), isinstance(t.id, str) and bool(t.id))
        for t in c.message.tool_calls or []
    ]
    content = c.message.content
    return {
        "object": resp.object,
        "model": resp.model,
        "types": (type(resp.id), type(resp.created)),
        "index": c.index,
        "role": c.message.role,
        "content": None if content is None else "json" if calls == [] else content,
        "calls": [(t, n, sorted(a), i) for t, n, a, i in calls],
        "finish_reason": c.finish_reason,
        "usage": sorted(
            k
            for k in ("prompt_tokens", "completion_tokens", "total_tokens")
            if isinstance(getattr(resp.usage, k), int)
        ),
    }


def check_values(resp, kind: str) -> None:
    c = resp.choices[0]
    if kind == "schema":
        jsonschema.validate(json.loads(c.message.content), CITY)
    else:
        for t in c.message.tool_calls:
            jsonschema.validate(json.loads(t.function.arguments), CITY)


@pytest.mark.parametrize("dialect", ["openai", "legacy", "loose"])
def test_local_and_cloud_answers_have_one_shape(fakes, start_router, local_engine, dialect):
    cloud, local, only_cloud = routers(fakes, start_router, local_engine)
    cloud.control(tool_dialect=dialect, json_fence=dialect != "openai")
    for kind, extra in REQUESTS.items():
        kw = dict(model=ALIAS, messages=MSG, max_tokens=60, temperature=0, **extra)
        if kind not in LOCAL_ANSWERS:  # greedy: the same for every dialect, asked once
            a = sdk(local).chat.completions.with_raw_response.create(**kw)
            assert a.headers["x-llmdeploy-backend"] == "local"
            LOCAL_ANSWERS[kind] = a.parse()
        b = sdk(only_cloud).chat.completions.with_raw_response.create(**kw)
        assert b.headers["x-llmdeploy-backend"] == "cloud"
        la, cb = LOCAL_ANSWERS[kind], b.parse()
        assert shape(la) == shape(cb), kind
        check_values(la, kind)
        check_values(cb, kind)


def assemble(stream) -> tuple[str, list[tuple[str, str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name
                    calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
                else:
                    calls[tc.index][2] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [(n, json.loads(a)) for _, n, a in calls.values()], finish


@pytest.mark.parametrize("dialect", ["openai", "legacy", "loose"])
def test_streamed_tool_calls_have_one_shape(fakes, start_router, local_engine, dialect):
    cloud, local, only_cloud = routers(fakes, start_router, local_engine)
    cloud.control(tool_dialect=dialect)
    kw = dict(model=ALIAS, messages=MSG, max_tokens=60, temperature=0, stream=True, **REQUESTS["named"])
    lc, lcalls, lfinish = assemble(sdk(local).chat.completions.create(**kw))
    cc, ccalls, cfinish = assemble(sdk(only_cloud).chat.completions.create(**kw))
    assert (lc, lfinish) == (cc, cfinish) == ("", "tool_calls")
    assert [n for n, _ in lcalls] == [n for n, _ in ccalls] == ["get_weather"]
    for _, args in lcalls + ccalls:
        jsonschema.validate(args, CITY)


def test_guided_json_goes_out_as_response_format(fakes, start_router, local_engine):
    cloud, _, only_cloud = routers(fakes, start_router, local_engine)
    out = sdk(only_cloud).chat.completions.create(
        model=ALIAS, messages=MSG, max_tokens=30, extra_body={"guided_json": CITY}
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), CITY)
    sent = cloud.requests()[-1]["body"]
    assert "guided_json" not in sent and sent["response_format"]["json_schema"]["schema"] == CITY


IMAGE = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is it?"},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        ],
    }
]


def test_capability_routing_end_to_end(fakes, start_router, local_engine):
    cloud, local, _ = routers(fakes, start_router, local_engine)
    # images: the tiny model has none, so the cloud serves them; a key without egress gets a 400 naming the param
    raw = sdk(local).chat.completions.with_raw_response.create(model=ALIAS, messages=IMAGE, max_tokens=5)
    assert raw.headers["x-llmdeploy-backend"] == "cloud"
    with pytest.raises(openai.BadRequestError) as err:
        sdk(local, LOCAL_ONLY_KEY).chat.completions.create(model=ALIAS, messages=IMAGE, max_tokens=5)
    assert err.value.body["param"] == "messages" and err.value.body["code"] == "unsupported_by_backends"
    # a context over the engine's max_model_len (1024) goes to the cloud
    long = sdk(local).chat.completions.with_raw_response.create(model=ALIAS, messages=MSG, max_tokens=4000)
    assert long.headers["x-llmdeploy-backend"] == "cloud"
    # logit_bias is local-only (the cloud has another tokenizer): served locally, and never sent out
    n_cloud = len(cloud.requests())
    lb = sdk(local).chat.completions.with_raw_response.create(
        model=ALIAS, messages=MSG, max_tokens=3, logit_bias={"5": 10}
    )
    assert lb.headers["x-llmdeploy-backend"] == "local" and len(cloud.requests()) == n_cloud
    metrics = httpx.get(f"{local.url}/metrics", headers={"authorization": f"Bearer {CLIENT_KEY}"}).text
    for label in ("cloud_only", "rejected", "local_only"):
        assert f'llmdeploy_router_capability_decisions_total{{decision="{label}"}}' in metrics


def test_access_log_names_the_capability_decision(fakes, start_router, local_engine, caplog):
    _, local, _ = routers(fakes, start_router, local_engine)
    with caplog.at_level("INFO", logger="llmdeploy.router.access"):
        sdk(local).chat.completions.create(model=ALIAS, messages=IMAGE, max_tokens=5)
    assert any("capability=cloud_only" in r.getMessage() for r in caplog.records)
