"""Schemathesis against both HTTP surfaces, from their OpenAPI documents (llmdeploy/openai_api/openapi.py):
valid and invalid bodies of every operation. Whatever arrives, no answer is a 5xx, every 4xx is in OpenAI's
error shape, and every answer carries a request id (the proxy's also the backend and revision).

Cases are generated first, once for both surfaces (they accept the same bodies), then sent 8 at a time so the
real engine batches them. The default run sends about a hundred per surface to the in-process router and the
tiny engine; the slow run sends >= 500 per surface to a whole deployment (LLMDEPLOY_RELIABILITY_FULL=1: 4x).
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import os
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.openapi import from_dict

from llmdeploy.openai_api.openapi import openapi_document
from tests.control.conftest import ALIAS as DEPLOYED_ALIAS
from tests.reliability.conftest import ID_HEADERS, engine_headers, error_of, local_first_spec
from tests.router.conftest import ALIAS, CLIENT_KEY, cloud_url

MAX_TOKENS, MAX_N = 4, 2  # keep generation short: robustness is the point, not long outputs
SENDERS = 8


def bounded(doc: dict[str, Any], alias: str) -> dict[str, Any]:
    """The document with the served model's name (other names are a plain 404) and output sizes capped (and
    max_tokens required), so that valid cases reach the engine and finish quickly."""
    doc = copy.deepcopy(doc)
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        s = doc["components"]["schemas"][name]
        s["properties"]["model"] = {"type": "string", "enum": [alias]}
        s["properties"]["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS}
        s["properties"]["n"] = {"type": "integer", "minimum": 1, "maximum": MAX_N}
        s["properties"]["min_tokens"] = {"type": "integer", "minimum": 0, "maximum": MAX_TOKENS}
        s["properties"].pop("max_completion_tokens", None)
        s["required"] = [*s.get("required", []), "max_tokens"]
    small(doc["components"]["schemas"])
    return doc


def small(node: Any) -> None:
    """Short strings, short arrays, few extra keys everywhere: a tiny CPU model prefills slowly, and small
    bodies are as good at finding parser and validation bugs as big ones (the size limits have their tests)."""
    if isinstance(node, list):
        for item in node:
            small(item)
        return
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    if kind == "string" and "enum" not in node:
        node.setdefault("maxLength", 24)
    elif kind == "array":
        node.setdefault("maxItems", max(3, node.get("minItems", 0)))
    elif kind == "object" and "properties" in node:
        node.setdefault("maxProperties", len(node["properties"]) + 2)
    for value in node.values():
        small(value)


def clamp(body: Any) -> Any:
    """An invalid case may break the caps above while staying valid for the server: bring it back under them."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and body[key] > MAX_TOKENS:
                body[key] = MAX_TOKENS
        if not isinstance(body.get("max_tokens"), int) and not isinstance(
            body.get("max_completion_tokens"), int
        ):
            body["max_tokens"] = MAX_TOKENS
        if isinstance(body.get("n"), int) and body["n"] > MAX_N:
            body["n"] = MAX_N
    return body


def examples(strategy: Any, count: int) -> list[Any]:
    found: list[Any] = []

    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(case: Any) -> None:
        found.append(case)

    collect()
    return found


# cases per operation and generation mode (valid, invalid): chat bodies are slow to generate, so fewer of them
SMALL = {
    "POST /v1/chat/completions": 6,
    "POST /v1/completions": 12,
    "POST /tokenize": 4,
    "POST /detokenize": 4,
}
LARGE = {
    "POST /v1/chat/completions": 40,
    "POST /v1/completions": 180,
    "POST /tokenize": 30,
    "POST /detokenize": 30,
}
GET_CASES = {False: 3, True: 8}
_corpus: dict[
    tuple[str, str, str, int], list[Any]
] = {}  # one corpus for both surfaces: they share the schemas


def generate(kind: str, alias: str, large: bool) -> list[Any]:
    counts = {**(LARGE if large else SMALL)}
    for k, v in list(counts.items()):
        counts[k] = v * (4 if large and os.environ.get("LLMDEPLOY_RELIABILITY_FULL") == "1" else 1)
    schema = from_dict(bounded(openapi_document(kind), alias))
    cases: list[Any] = []
    for result in schema.get_all_operations():
        op = result.ok()
        count = counts.get(op.label, GET_CASES[large])
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            key = (op.label, mode.value, alias, count)
            if key not in _corpus:
                try:
                    _corpus[key] = examples(op.as_strategy(generation_mode=mode), count)
                except Exception as exc:  # an operation with nothing to negate
                    if mode is GenerationMode.POSITIVE:
                        raise
                    print(f"{op.label}: no negative cases ({type(exc).__name__})")
                    _corpus[key] = []
            cases += _corpus[key]
    return cases


def send(case: Any, base_url: str, headers: dict[str, str]) -> tuple[str, int, dict, Any]:
    case.body = clamp(case.body)
    r = case.call(base_url=base_url, headers=headers, timeout=300)
    return f"{case.operation.label} {str(case.body)[:300]!r}", r.status_code, dict(r.headers), r


def run(
    kind: str, alias: str, base_url: str, headers: dict[str, str], large: bool, id_headers: tuple[str, ...]
) -> int:
    started = time.monotonic()
    cases = generate(kind, alias, large)
    generated = time.monotonic()
    with cf.ThreadPoolExecutor(SENDERS) as pool:
        answers = list(pool.map(lambda c: send(c, base_url, headers), cases))
    print(f"{kind}: generated in {generated - started:.1f}s, sent in {time.monotonic() - generated:.1f}s")
    problems = []
    for label, status, got, r in answers:
        lower = {k.lower() for k in got}
        if status >= 500:
            problems.append(f"{label}: {status} {r.text[:200]}")
        elif 400 <= status < 500:
            try:
                error_of(r)
            except (AssertionError, ValueError):
                problems.append(f"{label}: {status} not in OpenAI's error shape: {r.text[:200]}")
        if not set(id_headers) <= lower:
            problems.append(f"{label}: {status} without {set(id_headers) - lower}")
    statuses = sorted({a[1] for a in answers})
    print(f"{kind}: {len(answers)} cases, statuses {statuses}, {len(problems)} problems")
    assert not problems, "\n".join(problems[:20])
    return len(answers)


def test_proxy_schema_fuzz(fakes, start_router):
    cloud, engine = fakes
    rs = start_router(local_first_spec(cloud_url(cloud)), [engine.base])
    n = run("router", ALIAS, rs.url, {"authorization": f"Bearer {CLIENT_KEY}"}, False, ID_HEADERS)
    assert n >= 40


def test_engine_schema_fuzz(token_engine):
    n = run("engine", ALIAS, token_engine[1], engine_headers(), False, ("x-request-id",))
    assert n >= 40


@pytest.mark.slow
def test_proxy_schema_fuzz_whole_deployment(deployment):
    n = run("router", DEPLOYED_ALIAS, deployment.url, deployment.headers, True, ID_HEADERS)
    deployment.marks["schemathesis_proxy_cases"] = n
    assert n >= 500


@pytest.mark.slow
def test_engine_schema_fuzz_whole_deployment(deployment):
    url = deployment.engine()["url"]
    n = run("engine", DEPLOYED_ALIAS, url, deployment.engine_headers(), True, ("x-request-id",))
    deployment.marks["schemathesis_engine_cases"] = n
    assert n >= 500
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
