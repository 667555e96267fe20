"""Upstream errors (Qianfan v2 and legacy v1, vLLM nested and flat, OpenAI, bare statuses) -> OpenAIError,
plus whether the router may retry or fail over.

The client sees OpenAI's shape whatever answered. A cloud 401 is the operator's configuration problem
(cloud key or model permission), never the client's: it is logged clearly and answered 502 without details.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from llmdeploy.openai_api.errors import OpenAIError, context_length_exceeded, rate_limited

log = logging.getLogger("llmdeploy.router.upstream")

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
RATE_LIMIT_CODES = frozenset({"rpm_rate_limit_exceeded", "tpm_rate_limit_exceeded", "rate_limit_exceeded"})
CONTEXT_CODES = frozenset({"tokens_too_long", "context_length_exceeded"})
# Qianfan v1 answered HTTP 200 with these numeric codes in the body
LEGACY_RATE_LIMIT = frozenset({4, 17, 18, 336501, 336502})
LEGACY_CONTEXT = frozenset({336007, 336103})
MAX_MESSAGE = 500


@dataclass
class UpstreamFailure(Exception):
    """One failed attempt at a backend. `retryable`: the same backend may be tried again (cloud retries);
    `failover`: another backend may be tried; `client_error`: the request itself is at fault."""

    error: OpenAIError
    retryable: bool = False
    failover: bool = True
    retry_after_s: float | None = None
    kind: str = "upstream_error"  # metric label

    def __post_init__(self) -> None:
        super().__init__(self.error.message)


def parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: rare from APIs; backoff takes over


def body_error(data: Any) -> dict[str, Any] | None:
    """The error inside a body, if the body is one (also for HTTP 200 answers), in a common form."""
    if not isinstance(data, dict):
        return None
    err = data.get("error")
    if isinstance(err, dict) and ("message" in err or "code" in err):
        return {
            "message": err.get("message"),
            "type": err.get("type"),
            "param": err.get("param"),
            "code": err.get("code"),
        }
    if isinstance(err, str) and err:
        return {"message": err, "type": data.get("type"), "param": None, "code": data.get("code")}
    if data.get("object") == "error":  # vLLM / lmdeploy flat shape
        return {
            "message": data.get("message"),
            "type": data.get("type"),
            "param": data.get("param"),
            "code": data.get("code"),
        }
    for code_key, msg_key in (("error_code", "error_msg"), ("code", "msg")):  # Qianfan v1 legacy
        if (
            isinstance(data.get(code_key), int)
            and data[code_key] != 0
            and msg_key in data
            and "choices" not in data
        ):
            return {"message": data.get(msg_key), "type": None, "param": None, "code": data[code_key]}
    return None


def _clean(message: Any, secrets: tuple[str, ...]) -> str:
    text = str(message or "").strip()[:MAX_MESSAGE]
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    return text


def normalize(
    status: int,
    body: bytes | dict | None,
    headers=None,
    *,
    backend: str = "cloud",
    secrets: tuple[str, ...] = (),
) -> UpstreamFailure:
    """An upstream's failed answer -> UpstreamFailure. `status` is the HTTP status (200 for an error body)."""
    data = body
    if isinstance(body, (bytes, bytearray)):
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
    info = body_error(data) or {}
    code, message = info.get("code"), _clean(info.get("message"), secrets)
    retry_after = parse_retry_after(headers.get("retry-after") if headers is not None else None)
    where = "the cloud endpoint" if backend == "cloud" else "the local engine"

    if isinstance(code, int) and status == 200:
        if code in LEGACY_RATE_LIMIT:
            status = 429
        elif code in LEGACY_CONTEXT:
            return _context(message)
        else:
            status = 502
    elif isinstance(code, int) and 400 <= code < 600 and status in (200, 0):
        status = code  # vLLM puts the status in the body

    code_s = code if isinstance(code, str) else None
    if code_s in CONTEXT_CODES:
        return _context(message)
    if code_s == "insufficient_quota":
        err = OpenAIError(429, f"{where} has no quota left.", code="insufficient_quota")
        return UpstreamFailure(err, retryable=False, failover=True, kind="insufficient_quota")
    if status == 429 or code_s in RATE_LIMIT_CODES:
        wait = retry_after if retry_after is not None else 1.0
        return UpstreamFailure(
            rate_limited(f"{where} is rate limiting requests; retry later.", wait),
            True,
            True,
            retry_after,
            "rate_limited",
        )
    if status in (401, 403) and backend == "cloud":
        # configuration, not the client: wrong cloud key, or the key has no permission for cloud.model
        log.error(
            "cloud endpoint refused the configured credentials or model (HTTP %s, code %s): %s; check cloud.api_key_env "
            "and cloud.model",
            status,
            code_s or code,
            message or "no message",
        )
        err = OpenAIError(
            502,
            "The cloud endpoint rejected the deployment's configuration; the operator has been notified.",
            code="upstream_config_error",
        )
        return UpstreamFailure(err, retryable=False, failover=True, kind="upstream_auth")
    if status >= 500 or status == 0:
        err = OpenAIError(
            502,
            f"{where} failed ({status or 'no status'}): {message or 'server error'}",
            code="upstream_error",
        )
        return UpstreamFailure(
            err, retryable=status in RETRYABLE_STATUS, failover=True, retry_after_s=retry_after
        )
    if status == 404 and backend == "cloud":
        log.error(
            "cloud endpoint answered 404 (code %s): %s; check cloud.base_url and cloud.model", code_s, message
        )
        err = OpenAIError(
            502, "The cloud endpoint does not serve the configured model.", code="upstream_config_error"
        )
        return UpstreamFailure(err, retryable=False, failover=True, kind="upstream_config")
    # other 4xx: the request itself is at fault; passing it on elsewhere would fail the same way
    err = OpenAIError(
        status,
        message or f"{where} rejected the request ({status}).",
        type=info.get("type"),
        param=info.get("param"),
        code=code_s,
    )
    return UpstreamFailure(err, retryable=False, failover=False, kind="client_error")


def _context(message: str) -> UpstreamFailure:
    err = context_length_exceeded(message or "The prompt and max_tokens exceed the model's context length.")
    # another backend may have a longer context (the cloud model usually does)
    return UpstreamFailure(err, retryable=False, failover=True, kind="context_length")


def connect_failure(backend: str, exc: Exception) -> UpstreamFailure:
    where = "the cloud endpoint" if backend == "cloud" else "the local engine"
    err = OpenAIError(
        503,
        f"Could not reach {where} ({type(exc).__name__}).",
        code="upstream_unavailable",
        headers={"Retry-After": "1"},
    )
    return UpstreamFailure(err, retryable=True, failover=True, retry_after_s=None, kind="connect_error")


def timeout_failure(backend: str) -> UpstreamFailure:
    where = "the cloud endpoint" if backend == "cloud" else "the local engine"
    err = OpenAIError(504, f"{where} did not answer in time.", code="upstream_timeout")
    return UpstreamFailure(err, retryable=True, failover=True, kind="timeout")


def stream_cut(backend: str, exc: Exception | None = None) -> UpstreamFailure:
    """A committed stream that broke: a timeout says so, anything else is a cut (never 'could not reach')."""
    if isinstance(exc, httpx.TimeoutException):
        return timeout_failure(backend)
    why = f" ({type(exc).__name__})" if exc is not None else ""
    err = OpenAIError(
        502, f"The upstream stream was cut before it was complete{why}.", code="upstream_stream_cut"
    )
    return UpstreamFailure(err, False, False, kind="stream_cut")
