"""Token strings for logprobs: a token id's exact bytes and display string, and OpenAI's two logprob shapes
(chat's `content` list and the legacy completions object)."""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import Any

from llmdeploy.engine.outputs import TokenLogprob

MIN_LOGPROB = -9999.0  # OpenAI's stand-in for -inf (JSON has no infinity)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte<->unicode table, inverted: byte-level BPE pieces are strings of these stand-in characters."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """A token id's exact bytes and display string (OpenAI's logprob `token` and `bytes`), cached per id."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = "ByteLevel" in repr(decoder)
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def bytes_of(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self.special:
            return piece.encode()
        if self.byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if m := _SP_BYTE.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # sentencepiece's word-start marker is a space

    def get(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            raw = self.bytes_of(token_id)
            self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self._cache[token_id]


def _lp(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


def chat_logprobs(texts: TokenTexts, lps: list[TokenLogprob] | None, k: int) -> dict[str, Any] | None:
    if lps is None:
        return None
    content = []
    for lp in lps:
        token, raw = texts.get(lp.token_id)
        top = []
        for tid, val in lp.top[:k]:
            t, b = texts.get(tid)
            top.append({"token": t, "logprob": _lp(val), "bytes": b})
        content.append({"token": token, "logprob": _lp(lp.logprob), "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(
    texts: TokenTexts, lps: list[TokenLogprob] | None, k: int, offset: int
) -> dict[str, Any] | None:
    """The legacy shape; text_offset counts characters from the start of the choice's text."""
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        token = texts.get(lp.token_id)[0]
        tokens.append(token)
        token_lps.append(_lp(lp.logprob))
        tops.append({texts.get(tid)[0]: _lp(val) for tid, val in lp.top[:k]})
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(
    texts: TokenTexts, prompt_ids: list[int], lps: list[TokenLogprob | None], k: int
) -> dict[str, Any]:
    """echo with logprobs: the prompt's tokens in the legacy shape, offsets from the start of the choice's text.
    The first prompt token has no logprob (nothing precedes it): null there, as OpenAI answers."""
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for token_id, lp in zip(prompt_ids, lps, strict=True):
        token = texts.get(token_id)[0]
        tokens.append(token)
        token_lps.append(None if lp is None else _lp(lp.logprob))
        tops.append(None if lp is None else {texts.get(tid)[0]: _lp(val) for tid, val in lp.top[:k]})
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def joined_logprobs(prompt: dict[str, Any], generated: dict[str, Any] | None) -> dict[str, Any]:
    """The echoed prompt's logprobs, then the generated text's (legacy shape, key by key)."""
    if generated is None:
        return prompt
    return {key: prompt[key] + generated[key] for key in prompt}
