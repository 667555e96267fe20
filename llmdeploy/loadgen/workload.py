"""What bench sends: synthetic prompts of a given length, a long/short mix, or a JSONL dataset.

Synthetic prompts are words, not tokens: common short English words that the usual byte-level BPE vocabularies
(GPT-2, Llama, SmolLM2, Qwen) hold as one token each with their leading space, so N words is about N prompt
tokens (with SmolLM2's tokenizer, 1000 such words are exactly 1000 tokens); the chat template adds its own few
dozen. The server's usage.prompt_tokens, when it sends usage, is recorded per level (mean_prompt_tokens in the
JSON report), so the real length can be checked. Each request gets a different word order (seeded), so a prefix
cache cannot serve one prompt from another.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmdeploy.loadgen.parse import Mix

PromptKind = Literal["synthetic", "long", "short", "dataset"]

_COMMON_WORDS = (
    "the of and to in is that it for on was with as be at by this have from or one had not but what all were "
    "when we there can an your which their said if do will each about how up out them then she many some so "
    "these would other into has more her two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after words called just where "
    "most know get through back much go good new write our me man too any day same right look think also "
    "around another came come work three word must because does part even place well such here take why things"
)
WORDS = tuple(_COMMON_WORDS.split())


@dataclass(frozen=True)
class PlannedRequest:
    messages: list[dict[str, Any]]
    max_tokens: int | None
    kind: PromptKind


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names FILE:LINE."""


def synthetic_text(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@dataclass
class Workload:
    """An endless, seeded sequence of requests; `next()` is called once per request sent."""

    output_len: int
    prompt_len: int = 128
    mix: Mix | None = None
    dataset: list[PlannedRequest] | None = None
    seed: int = 0
    dataset_path: str | None = None  # for the report, so --compare can run the same file again

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._i = 0

    def next(self) -> PlannedRequest:
        if self.dataset:
            item = self.dataset[self._i % len(self.dataset)]
            self._i += 1
            return (
                item
                if item.max_tokens is not None
                else PlannedRequest(item.messages, self.output_len, "dataset")
            )
        if self.mix is not None:
            long = self._rng.random() < self.mix.long_share
            n, kind = (self.mix.long_len, "long") if long else (self.mix.short_len, "short")
        else:
            n, kind = self.prompt_len, "synthetic"
        text = synthetic_text(n, self._rng)
        return PlannedRequest([{"role": "user", "content": text}], self.output_len, kind)

    def describe(self) -> dict[str, Any]:
        if self.dataset:
            return {
                "kind": "dataset",
                "dataset": self.dataset_path,
                "requests_in_file": len(self.dataset),
                "output_len": self.output_len,
            }
        if self.mix is not None:
            return {
                "kind": "mix",
                "long_len": self.mix.long_len,
                "short_len": self.mix.short_len,
                "long_share": self.mix.long_share,
                "output_len": self.output_len,
            }
        return {"kind": "synthetic", "prompt_len": self.prompt_len, "output_len": self.output_len}


def load_dataset(path: Path) -> list[PlannedRequest]:
    """JSONL, one object per line: {"prompt": "..."} or {"messages": [...]}, optional "max_tokens".

    Blank lines are skipped. A `prompt` is sent as one user message (bench talks to /v1/chat/completions).
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    items = [_dataset_item(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not items:
        raise DatasetError(f"{path}: no requests in the file (one JSON object per line)")
    return items


def _dataset_item(path: Path, n: int, line: str) -> PlannedRequest:
    where = f"{path}:{n}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: each line must be a JSON object with prompt or messages")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise DatasetError(f"{where}: give exactly one of prompt or messages")
    if has_prompt:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise DatasetError(f"{where}: prompt must be a non-empty string")
        messages = [{"role": "user", "content": obj["prompt"]}]
    else:
        messages = obj["messages"]
        ok = (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages
            )
        )
        if not ok:
            raise DatasetError(f"{where}: messages must be a non-empty list of {{role, content}} objects")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise DatasetError(f"{where}: max_tokens must be a whole number >= 1")
    return PlannedRequest(messages, max_tokens, "dataset")
