"""Turning an HTTP request into a checked OpenAI request: body size, JSON, alias, schema, size estimates.

The admission order (docs/ARCHITECTURE.md §3.1) is kept by the caller: auth, then these, then the rate
limit.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import ValidationError

from llmdeploy.openai_api import bodies
from llmdeploy.openai_api.asgi import ClientGone, read_capped
from llmdeploy.openai_api.errors import (
    OpenAIError,
    from_validation_errors,
    invalid_request,
    model_not_found,
)
from llmdeploy.openai_api.schemas import ChatCompletionRequest, CompletionRequest
from llmdeploy.policies.prompt_size import FALLBACK, PromptShape

PREFIX_KEY_BYTES = 512  # a completion prompt's prefix key: its first bytes (or ids), a few KV blocks' worth
DEFAULT_MAX_TOKENS_GUESS = 256  # when the client sets no limit, plan KV room for this much output
SCHEMAS = {"chat/completions": ChatCompletionRequest, "completions": CompletionRequest}


async def read_body(request, limit: int) -> bytes:
    try:
        return await read_capped(request, limit)
    except ClientGone:  # gone mid-body (or cut by the server's read deadline): nobody to answer
        raise client_closed() from None


def client_closed() -> OpenAIError:
    return OpenAIError(499, "The client closed the request.", code="client_closed")


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
