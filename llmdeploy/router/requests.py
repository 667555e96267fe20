"""Turning an HTTP request into a checked OpenAI request: body size, JSON, alias, schema, size estimates.

Order (DESIGN rule 1) is kept by the caller: auth, then these, then the rate limit.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import Any

from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from llmdeploy.openai_api import bodies
from llmdeploy.openai_api.errors import (
    OpenAIError,
    from_validation_errors,
    invalid_request,
    model_not_found,
    payload_too_large,
)
from llmdeploy.openai_api.guard import answer_unexpected
from llmdeploy.openai_api.schemas import ChatCompletionRequest, CompletionRequest
from llmdeploy.policies.prompt_size import FALLBACK, PromptShape

PREFIX_KEY_BYTES = 512  # a completion prompt's prefix key: its first bytes (or ids), a few KV blocks' worth
DEFAULT_MAX_TOKENS_GUESS = 256  # when the client sets no limit, plan KV room for this much output
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
SCHEMAS = {"chat/completions": ChatCompletionRequest, "completions": CompletionRequest}


def request_id(incoming: str | None) -> str:
    """The client's x-request-id when it is a sane token (so logs correlate), else a new one."""
    if incoming and REQUEST_ID.match(incoming):
        return incoming
    return uuid.uuid4().hex


async def read_body(request, limit: int) -> bytes:
    bodies.check_content_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise payload_too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise payload_too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-body (or cut by the server's read deadline): nobody to answer
        raise client_closed() from None
    return b"".join(chunks)


def client_closed() -> OpenAIError:
    return OpenAIError(499, "The client closed the request.", code="client_closed")


async def until_disconnect(receive) -> None:
    """Returns when the client disconnects (call it only once the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def parse_json(raw: bytes) -> dict[str, Any]:
    data = bodies.loads(raw)  # every failure (bad JSON, NaN, nesting, RecursionError) is 400 invalid_json
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


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def prompt_shape(req: ChatCompletionRequest | CompletionRequest) -> PromptShape:
    """Bytes, messages and token ids of the prompt: each engine turns them into tokens with its own tokenizer's
    coefficients (llmdeploy/policies/prompt_size.py)."""
    if isinstance(req, ChatCompletionRequest):
        return PromptShape(sum(_utf8_len(m.text()) for m in req.messages), messages=len(req.messages))
    p = req.prompt
    if isinstance(p, str):
        return PromptShape(_utf8_len(p))
    if p and isinstance(p[0], int):
        return PromptShape(token_ids=len(p))
    texts = [x for x in p if isinstance(x, str)]
    ids = sum(len(x) for x in p if not isinstance(x, str))
    return PromptShape(sum(_utf8_len(x) for x in texts), prompts=max(1, len(texts)), token_ids=ids)


def prefix_key(req: ChatCompletionRequest | CompletionRequest) -> str | None:
    """A hash of the prompt's part that later requests reuse (policies/affinity.py): a chat's messages up to and
    including the first user message (the system prompt and the conversation's opening: every later turn
    repeats them), a completion prompt's first PREFIX_KEY_BYTES bytes. A hash, so no prompt text is kept."""
    if isinstance(req, ChatCompletionRequest):
        first_user = next((i for i, m in enumerate(req.messages) if m.role == "user"), len(req.messages) - 1)
        parts = [f"{m.role}\0{m.text()}" for m in req.messages[: first_user + 1]]
        material = "\x1e".join(parts).encode("utf-8", "surrogatepass")
    else:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of prompts: the first one's prefix
        if isinstance(p, str):
            material = b"t" + p.encode("utf-8", "surrogatepass")[:PREFIX_KEY_BYTES]
        else:
            material = b"i" + ",".join(str(t) for t in p[: PREFIX_KEY_BYTES // 4]).encode()
    return hashlib.sha256(material).hexdigest()[:32] if len(material) > 1 else None


def estimate_prompt_tokens(req: ChatCompletionRequest | CompletionRequest) -> int:
    """Without an engine's coefficients: about 4 bytes a token, 4 template tokens a message."""
    return FALLBACK.tokens(prompt_shape(req))


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

        started = False

        async def send_with_ids(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", ()))
                present = {k.lower() for k, _ in headers}
                headers += [(k, v) for k, v in defaults if k not in present]
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, send_with_ids)
        except Exception as exc:  # a bug: still a 500 in OpenAI's shape with the ids, logged once
            await answer_unexpected(send_with_ids, started, exc, f"router request {rid}")
