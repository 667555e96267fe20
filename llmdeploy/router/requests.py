"""Turning an HTTP request into a checked OpenAI request: body size, JSON, alias, schema, size estimates.

Order (DESIGN rule 1) is kept by the caller: auth, then these, then the rate limit.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from pydantic import ValidationError

from llmdeploy.openai_api.errors import (
    OpenAIError,
    from_validation_errors,
    invalid_json,
    invalid_request,
    model_not_found,
    payload_too_large,
)
from llmdeploy.openai_api.schemas import ChatCompletionRequest, CompletionRequest

BYTES_PER_TOKEN = 4  # ~4 bytes of UTF-8 per token: 4 ASCII chars, or 1-2 CJK chars; good enough to predict
DEFAULT_MAX_TOKENS_GUESS = 256  # when the client sets no limit, plan KV room for this much output
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
SCHEMAS = {"chat/completions": ChatCompletionRequest, "completions": CompletionRequest}


def request_id(incoming: str | None) -> str:
    """The client's x-request-id when it is a sane token (so logs correlate), else a new one."""
    if incoming and REQUEST_ID.match(incoming):
        return incoming
    return uuid.uuid4().hex


async def read_body(request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise payload_too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise payload_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _no_constants(name: str) -> None:
    raise ValueError(
        f"{name} is not valid JSON"
    )  # Python's json accepts NaN/Infinity; JSON and upstreams do not


def parse_json(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise invalid_json("empty body")
    try:
        data = json.loads(raw, parse_constant=_no_constants)
    except ValueError as exc:
        raise invalid_json(str(exc)[:200]) from None
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.")
    return data


def check_alias(data: dict[str, Any], aliases: list[str]) -> str:
    """The served name the request asks for (the first one when it names none); 404 for any other."""
    model = data.get("model")
    if not isinstance(model, str):
        return aliases[0]
    if model not in aliases:
        raise model_not_found(model[:128])
    return model


def validate(data: dict[str, Any], endpoint: str) -> ChatCompletionRequest | CompletionRequest:
    try:
        return SCHEMAS[endpoint].model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors(include_url=False))) from None
    except (TypeError, ValueError) as exc:  # a validator tripping on a strange value
        raise invalid_request(f"Invalid request: {str(exc)[:200]}") from None


def _text_tokens(text: str) -> int:
    return -(-len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)


def estimate_prompt_tokens(req: ChatCompletionRequest | CompletionRequest) -> int:
    if isinstance(req, ChatCompletionRequest):
        return sum(_text_tokens(m.text()) + 4 for m in req.messages)  # +4: role and template tokens
    p = req.prompt
    if isinstance(p, str):
        return _text_tokens(p)
    if p and isinstance(p[0], int):
        return len(p)
    return sum(_text_tokens(x) if isinstance(x, str) else len(x) for x in p)


def planned_output_tokens(req: ChatCompletionRequest | CompletionRequest) -> int:
    return (req.output_limit or DEFAULT_MAX_TOKENS_GUESS) * req.n


def rejected(status: int, code: str, message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(status, message, param=param, code=code)


class RequestIdMiddleware:
    """Pure ASGI: every response carries x-request-id, x-llmdeploy-backend and x-llmdeploy-revision."""

    def __init__(self, app, on_first_request=None) -> None:
        self.app = app
        self.on_first_request = on_first_request

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.on_first_request is not None:
            # embedders may run the app with lifespan off: start the load poller on first use then
            await self.on_first_request()
        incoming = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"").decode("latin-1")
        rid = request_id(incoming)
        scope.setdefault("state", {})["rid"] = rid
        defaults = (
            (b"x-request-id", rid.encode()),
            (b"x-llmdeploy-backend", b"none"),
            (b"x-llmdeploy-revision", b"none"),
        )

        async def send_with_ids(message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                present = {k.lower() for k, _ in headers}
                headers += [(k, v) for k, v in defaults if k not in present]
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_ids)
