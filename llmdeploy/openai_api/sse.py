"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`.

Shared by the engine server (which produces streams) and the router (which relays and ends them).
"""

from __future__ import annotations

import json
from typing import Any

from llmdeploy.openai_api.errors import OpenAIError

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
# proxies (nginx) buffer responses unless told not to; a buffered stream defeats its purpose
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_error_end(err: OpenAIError) -> bytes:
    """How a stream ends when it fails after its first chunk: an error event, then [DONE] (never a fake stop)."""
    return err.sse_event() + DONE
