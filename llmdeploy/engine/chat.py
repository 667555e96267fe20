"""Chat messages -> prompt token ids through the model's own chat template (from the same source as the weights)."""

from __future__ import annotations

from typing import Any

from llmdeploy.openai_api.errors import invalid_request
from llmdeploy.openai_api.schemas import ChatMessage


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: list[ChatMessage]) -> str:
    """The prompt text the model was trained to continue: the template with an open assistant turn."""
    if not has_chat_template(tokenizer):
        raise invalid_request(
            "This model has no chat template; use /v1/completions with a plain prompt instead.",
            param="messages",
            code="chat_template_missing",
        )
    plain = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]
    try:
        return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # templates raise their own errors (e.g. "roles must alternate")
        raise invalid_request(f"The chat template rejected these messages: {exc}", param="messages") from None


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    # the template already writes BOS and other special tokens as text; encoding must not add them twice
    return list(tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False))


def text_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    return list(tokenizer.encode(prompt, add_special_tokens=True))
