"""Request bodies as both servers accept them: the Content-Type, then JSON within limits, else an OpenAIError.

The router and the engine server read bodies the same way, so a body one accepts the other accepts too, and a
body neither can parse is a 400 in OpenAI's shape, never a 500 (deeply nested JSON raised RecursionError).
"""

from __future__ import annotations

import json
from typing import Any

from llmdeploy.openai_api.errors import invalid_json, unsupported_media_type

# OpenAI bodies nest a few levels (a tool's JSON schema maybe twenty); anything deeper is an attack on the
# parser or on json.dumps further down (both recurse), refused before it gets there
MAX_JSON_DEPTH = 64
JSON_MEDIA_TYPE = "application/json"


def check_content_type(value: str | None) -> None:
    """application/json (any parameters, e.g. charset) or no Content-Type at all, as OpenAI accepts; else 415."""
    if value is None or not value.strip():
        return
    if value.split(";", 1)[0].strip().lower() != JSON_MEDIA_TYPE:
        raise unsupported_media_type(value)


def _no_constants(name: str) -> None:
    raise ValueError(
        f"{name} is not valid JSON"
    )  # Python's json accepts NaN/Infinity; JSON and upstreams do not


def nesting_exceeds(data: Any, limit: int) -> bool:
    """Whether arrays/objects nest deeper than `limit` (iterative: the check itself must not recurse)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def loads(raw: bytes) -> Any:
    """Parse a request body; every way it can fail is invalid_json (400)."""
    if not raw.strip():
        raise invalid_json("empty body")
    try:
        data = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:
        raise invalid_json(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise invalid_json(str(exc)[:200]) from None
    # cheap pre-check: fewer brackets than the limit cannot nest past it (the walk is only for odd bodies)
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets > MAX_JSON_DEPTH and isinstance(data, (dict, list)) and nesting_exceeds(data, MAX_JSON_DEPTH):
        raise invalid_json(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return data
