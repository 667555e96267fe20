"""OpenAPI 3.1 documents of the two HTTP surfaces, built from the same pydantic models the servers validate with.

Neither server serves these (the apps run with openapi_url=None); they exist for tools that read a schema, the
reliability suite's schemathesis runs above all: `openapi_document("router")` describes the proxy's routes,
`openapi_document("engine")` an engine's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic.json_schema import models_json_schema

from llmdeploy.openai_api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

REF = "#/components/schemas/{model}"
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": ["string", "null"]},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}


def _post(model: str, summary: str) -> dict[str, Any]:
    body = {"$ref": REF.format(model=model)}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": _responses(),
        }
    }


def _get(summary: str, parameters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": _responses()}
    if parameters:
        op["parameters"] = parameters
    return {"get": op}


def _responses() -> dict[str, Any]:
    error = {
        "description": "an error",
        "content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}},
    }
    return {"200": {"description": "the answer"}, "default": error}


def openapi_document(kind: Literal["router", "engine"]) -> dict[str, Any]:
    models = [ChatCompletionRequest, CompletionRequest]
    if kind == "engine":
        models += [TokenizeRequest, DetokenizeRequest]
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas = {**defs.get("$defs", {}), "Error": ERROR_SCHEMA}
    paths: dict[str, Any] = {
        "/v1/chat/completions": _post("ChatCompletionRequest", "chat completion (stream or not)"),
        "/v1/completions": _post("CompletionRequest", "text completion (stream or not)"),
        "/v1/models": _get("the served model"),
        "/health": _get("liveness"),
        "/metrics": _get("Prometheus metrics"),
    }
    if kind == "router":
        paths["/ready"] = _get("can a backend serve now")
        security = {"bearer": {"type": "http", "scheme": "bearer"}}
    else:
        paths["/tokenize"] = _post("TokenizeRequest", "prompt or messages -> token ids")
        paths["/detokenize"] = _post("DetokenizeRequest", "token ids -> text")
        paths["/load"] = _get("queue, KV room and rates for the router")
        model_param = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
        paths["/v1/models/{model}"] = _get("one model card", [model_param])
        security = {"engine_token": {"type": "apiKey", "in": "header", "name": "x-llmdeploy-engine-token"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": f"llmdeploy {kind}", "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": security},
        "security": [{name: []} for name in security],
    }
