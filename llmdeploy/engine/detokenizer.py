"""Incremental detokenization and stop strings, per sequence.

Text grows by decoding a short window of ids (prefix_offset..) and keeping what the newest ids add, as vLLM
does: merged or multi-byte tokens decode correctly and a trailing U+FFFD (an incomplete UTF-8 character) waits
for the next token. Stop strings: the earliest match ends the text; while streaming, the longest tail of the
text that could still grow into a stop string is held back, so no part of a stop string is ever emitted.
"""

from __future__ import annotations

from typing import Any

from llmdeploy.engine.sampling_params import SamplingParams

INITIAL_WINDOW = 5  # prompt tokens decoded with the first output tokens (leading spaces, merges)


class Detokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams):
        self.tokenizer, self.params = tokenizer, params
        self.ids = list(prompt_ids[-INITIAL_WINDOW:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text = ""  # decoded so far (may run past a stop string until it is found)
        self.emitted = 0  # characters of text already handed out
        self.stops = params.stop
        self.max_stop_len = max((len(s) for s in self.stops), default=0)

    def _decode(self, ids: list[int]) -> str:
        skip = self.params.skip_special_tokens
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        # the Rust decoder directly: transformers' decode adds ~20 us of Python per call
        if backend is not None:
            return backend.decode(ids, skip_special_tokens=skip)
        return self.tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one output token; returns the text it added (possibly '' until a character completes)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one output token; returns the stop string it completed (the text is then cut), else None."""
        added = self.add(token_id)
        return self.find_stop(len(added)) if added and check_stop else None

    def flush(self) -> None:
        """At the end: whatever is still pending (an incomplete character decodes as U+FFFD, as a full decode would)."""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix):
                self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset = len(self.ids)

    def find_stop(self, num_new_chars: int) -> str | None:
        """Earliest stop string in the text that the last `num_new_chars` characters could have completed;
        on a match the text is cut there (after it with include_stop_str_in_output)."""
        if not self.stops or not num_new_chars:
            return None
        start = max(0, len(self.text) - num_new_chars - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + (len(s) if self.params.include_stop_str_in_output else 0)]
        self.emitted = min(self.emitted, len(self.text))
        return s

    def held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        text, n = self.text, 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), n, -1):
                if text.endswith(s[:k]):
                    n = k
                    break
        return n

    def emit(self, finished: bool) -> str:
        """New text safe to hand out now."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.held_back())
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    @property
    def output_text(self) -> str:
        return self.text[: self.emitted]
