"""One access-log line per request (docs/ARCHITECTURE.md §3.6): ids, key name, backend, revision, status,
tokens, timings.

Never a key. Prompt and completion text only when `logging.bodies` is on.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("llmdeploy.router.access")


@dataclass
class AccessRecord:
    request_id: str
    method: str
    path: str
    key: str = "-"
    status: int = 0
    backend: str = "none"
    revision: str = "none"
    replica: str = "-"
    stream: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    overflow: str | None = None
    attempts: int = 0
    error: str | None = None
    capability: str | None = None  # which backends could serve it (policies/capability.py LABELS)
    continued: str | None = None  # the backend that finished a stream after the first one failed
    body: Any = None  # only with logging.bodies
    completion: str | None = None  # only with logging.bodies


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    return text if text and all(c.isalnum() or c in "-_./:" for c in text) else json.dumps(text)


def format_record(rec: AccessRecord, bodies: bool) -> str:
    fields = [
        ("rid", rec.request_id),
        ("key", rec.key),
        ("method", rec.method),
        ("path", rec.path),
        ("status", rec.status),
        ("backend", rec.backend),
        ("revision", rec.revision),
        ("replica", rec.replica),
        ("stream", rec.stream),
        ("prompt_tokens", rec.prompt_tokens),
        ("completion_tokens", rec.completion_tokens),
        ("ttft_ms", rec.ttft_ms),
        ("e2e_ms", rec.e2e_ms),
        ("overflow", rec.overflow),
        ("attempts", rec.attempts),
        ("error", rec.error),
        ("continued", rec.continued),
        ("capability", rec.capability),
    ]
    if bodies:
        fields += [
            ("body", json.dumps(rec.body, ensure_ascii=False) if rec.body is not None else None),
            ("completion", rec.completion),
        ]
    return " ".join(f"{k}={_fmt(v)}" for k, v in fields if v is not None)


def log_access(rec: AccessRecord, bodies: bool) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info(format_record(rec, bodies))
