"""OpenAI's error shape, built here and only here: {"error": {"message", "type", "param", "code"}}.

Engine server and router both raise OpenAIError and install the same handlers, so every error a client sees,
whatever produced it, has one shape and never leaks a traceback or a secret.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("llmdeploy.errors")

TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "timeout_error",
}


@dataclass
class OpenAIError(Exception):
    status: int
    message: str
    type: str | None = None
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)
        if self.type is None:
            self.type = TYPE_BY_STATUS.get(
                self.status, "server_error" if self.status >= 500 else "invalid_request_error"
            )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_event(self) -> bytes:
        """The stream-ending event after the commit point (followed by [DONE] by the caller)."""
        return f"data: {json.dumps(self.body())}\n\n".encode()


def error_body(
    message: str,
    type: str | None = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def invalid_json(detail: str = "") -> OpenAIError:
    suffix = f": {detail}" if detail else ""
    return OpenAIError(400, f"The request body is not valid JSON{suffix}", code="invalid_json")


def model_not_found(model: str | None) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def context_length_exceeded(message: str, param: str = "messages") -> OpenAIError:
    return OpenAIError(400, message, param=param, code="context_length_exceeded")


def invalid_api_key() -> OpenAIError:
    return OpenAIError(
        401,
        "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>' or in the 'api-key' header.",
        code="invalid_api_key",
    )


def rate_limited(message: str, retry_after_s: float, code: str = "rate_limit_exceeded") -> OpenAIError:
    return OpenAIError(429, message, code=code, headers={"Retry-After": str(max(1, round(retry_after_s)))})


def overloaded(message: str, retry_after_s: float, code: str = "overloaded") -> OpenAIError:
    return OpenAIError(503, message, code=code, headers={"Retry-After": str(max(1, round(retry_after_s)))})


def payload_too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413, f"Request body is larger than the limit of {limit} bytes.", code="request_too_large"
    )


def unsupported_media_type(content_type: str) -> OpenAIError:
    shown = content_type.split(";", 1)[0].strip()[:80] or "(empty)"
    return OpenAIError(
        415,
        f"Unsupported Content-Type {shown!r}: send the body as application/json.",
        code="unsupported_media_type",
    )


def unauthorized_internal() -> OpenAIError:
    """The engine's own check: only the router (which holds the deployment's internal token) may call it."""
    return OpenAIError(
        401,
        "This engine serves only its deployment's router; send requests to the router's URL.",
        code="invalid_internal_token",
    )


def server_error(message: str = "The server had an error while processing your request.") -> OpenAIError:
    return OpenAIError(500, message, code="internal_error")


def param_of(loc: tuple[Any, ...]) -> str | None:
    """pydantic loc ('body', 'messages', 0, 'role') -> 'messages[0].role'."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def from_validation_errors(errors: list[dict[str, Any]]) -> OpenAIError:
    if not errors:
        return invalid_request("Invalid request.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return invalid_json(str(first.get("ctx", {}).get("error", "")))
    param = param_of(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    return invalid_request(f"Invalid value for '{param}': {msg}" if param else msg, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_errors(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "Request failed."
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return OpenAIError(exc.status_code, message, code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error: %s", type(exc).__name__)
        return server_error().response()
