"""`routing.continue_on_failure: cloud`: a local stream that fails after its first token is finished by the cloud.

The cloud gets the same request with the text streamed so far as an assistant prefix (chat) or appended to the
prompt (completions), and the tokens left of the client's limit. Its chunks reach the client in the same
stream, each carrying CONTINUED_MARK, so a client can tell that the rest came from elsewhere; the access log
says `continued=cloud`. Only single-choice requests qualify (n=1, one prompt, no echo).
"""

from __future__ import annotations

from typing import Any

CHAT = "chat/completions"
# the field every chunk from the backend that took over carries (the OpenAI SDK keeps unknown fields)
CONTINUED_MARK: dict[str, Any] = {"llmdeploy": {"continued_on": "cloud", "failed": "local"}}


def resumable(body: dict[str, Any], endpoint: str) -> bool:
    if (body.get("n") or 1) != 1:
        return False
    if endpoint == CHAT:
        return isinstance(body.get("messages"), list)
    return isinstance(body.get("prompt"), str) and not body.get("echo")


def continuation_body(
    body: dict[str, Any], endpoint: str, text: str, tokens_so_far: int
) -> dict[str, Any] | None:
    """The request that continues a stream after `text` (`tokens_so_far` tokens); None when nothing is left."""
    out = dict(body)
    for key in ("max_completion_tokens", "max_tokens"):
        limit = body.get(key)
        if isinstance(limit, int):
            left = limit - tokens_so_far
            if left < 1:
                return None
            out[key] = left
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(0, body["min_tokens"] - tokens_so_far)
    if endpoint == CHAT:
        out["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
    else:
        out["prompt"] = body["prompt"] + text
    return out
