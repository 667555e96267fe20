"""A request's prompt tokens, estimated before anything is tokenized (the engine counts them exactly later).

Each engine measures its tokenizer and chat template once at start (llmdeploy/engine/prompt_size.py) and
publishes the coefficients in /load; the router applies them to the request's shape. Without them (an older or
foreign engine): 4 bytes a token and 4 template tokens a message.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class PromptShape:
    """What the router can see of a prompt without a tokenizer."""

    text_bytes: int = 0  # UTF-8 bytes of the text (message contents, or completion prompts)
    messages: int | None = None  # chat messages; None: a completion prompt
    prompts: int = 1  # completion prompts in one request (each gets the special tokens)
    token_ids: int = 0  # prompt tokens given as ids: counted exactly


@dataclass(frozen=True)
class PromptSize:
    per_byte: float  # tokens per UTF-8 byte of text
    per_message: float  # template tokens each chat message adds (role markers, separators)
    chat_fixed: float  # template tokens of any chat prompt (a default system prompt, the assistant opener)
    text_fixed: float  # special tokens each completion prompt gets (BOS)

    def tokens(self, shape: PromptShape) -> int:
        if shape.messages is None:
            fixed = self.text_fixed * shape.prompts if shape.text_bytes else 0.0
        else:
            fixed = self.chat_fixed + self.per_message * shape.messages
        return max(1, math.ceil(self.per_byte * shape.text_bytes + fixed) + shape.token_ids)

    def to_json(self) -> dict[str, Any]:
        return {k: round(v, 4) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: Any) -> PromptSize | None:
        if not isinstance(data, dict):
            return None
        try:
            return cls(*(float(data[k]) for k in ("per_byte", "per_message", "chat_fixed", "text_fixed")))
        except (KeyError, TypeError, ValueError):
            return None


FALLBACK = PromptSize(per_byte=0.25, per_message=4.0, chat_fixed=0.0, text_fixed=0.0)
