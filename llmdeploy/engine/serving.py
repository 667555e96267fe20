"""OpenAI requests -> prompt token ids + SamplingParams; RequestOutputs -> OpenAI responses and stream chunks.

Pure functions and small formatters over plain data: no HTTP, no engine calls, so every shape is testable alone.
"""

from __future__ import annotations

import logging
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from llmdeploy.engine.chat import chat_prompt_ids, text_prompt_ids
from llmdeploy.engine.errors import CapacityError, ContextLengthError, ParamError
from llmdeploy.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from llmdeploy.engine.sampling_params import SamplingParams
from llmdeploy.openai_api.errors import (
    OpenAIError,
    context_length_exceeded,
    from_validation_errors,
    invalid_request,
    model_not_found,
    server_error,
)
from llmdeploy.openai_api.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("llmdeploy.engine.server")
M = TypeVar("M", bound=BaseModel)
MIN_LOGPROB = -9999.0  # OpenAI's stand-in for -inf (JSON has no infinity)


@dataclass
class Prompt:
    token_ids: list[int]
    text: str  # what `echo` prepends


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- requests ---------------------------------------------------------------------------------------------


def chat_prompts(tokenizer: Any, req: ChatCompletionRequest) -> list[Prompt]:
    return [Prompt(chat_prompt_ids(tokenizer, req.messages), "")]


def completion_prompts(tokenizer: Any, req: CompletionRequest) -> list[Prompt]:
    if req.suffix is not None:
        raise invalid_request("`suffix` is not supported by this server.", param="suffix")
    p = req.prompt
    if isinstance(p, str):
        raw: list[str | list[int]] = [p]
    elif all(isinstance(x, int) for x in p):
        raw = [list(p)]  # type: ignore[arg-type]
    else:
        raw = list(p)  # type: ignore[arg-type]
    prompts = []
    for item in raw:
        if isinstance(item, str):
            prompts.append(Prompt(text_prompt_ids(tokenizer, item), item))
        else:
            prompts.append(Prompt(list(item), tokenizer.decode(item) if req.echo else ""))
    if any(not pr.token_ids for pr in prompts):
        raise invalid_request("The prompt is empty after tokenization.", param="prompt")
    vocab = len(tokenizer)
    if any(t < 0 or t >= vocab for pr in prompts for t in pr.token_ids):
        raise invalid_request(f"Prompt token ids must be in [0, {vocab}).", param="prompt")
    return prompts


def _extra(req: Any, name: str, default: Any) -> Any:
    """vLLM's extra sampling fields (sent via the SDK's extra_body); unknown fields are tolerated, these used."""
    value = (req.model_extra or {}).get(name, default)
    if not isinstance(value, type(default)):
        raise invalid_request(f"'{name}' must be a {type(default).__name__}.", param=name)
    return value


def sampling_params(req: ChatCompletionRequest | CompletionRequest, logprobs: int | None) -> SamplingParams:
    """Unset OpenAI fields take OpenAI's defaults; an unset output limit (None) means 'the rest of the context'."""
    return SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        max_tokens=req.output_limit,
        min_tokens=req.min_tokens,
        stop=list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=_extra(req, "skip_special_tokens", True),
        include_stop_str_in_output=_extra(req, "include_stop_str_in_output", False),
    )


def chat_logprobs_k(req: ChatCompletionRequest) -> int | None:
    return (req.top_logprobs or 0) if req.logprobs else None


def completion_logprobs_k(req: CompletionRequest) -> int | None:
    if req.echo and req.logprobs is not None:
        raise invalid_request(
            "`echo` together with `logprobs` is not supported (no prompt logprobs).", param="echo"
        )
    return req.logprobs


def validate(model_cls: type[M], body: dict[str, Any]) -> M:
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors())) from None


def check_alias(body: dict[str, Any], alias: str, required: bool) -> None:
    model = body.get("model")
    if model is None and not required:
        return
    if isinstance(model, str) and model != alias:
        raise model_not_found(model)


def engine_error(exc: BaseException, prompt_param: str) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ParamError):
        return invalid_request(exc.message, param=exc.param)
    if isinstance(exc, (ContextLengthError, CapacityError)):
        return context_length_exceeded(exc.message, param=prompt_param)
    log.error("engine failed a request: %s: %s", type(exc).__name__, exc)
    return server_error(f"The engine failed while generating ({type(exc).__name__}).")


# ---- token strings for logprobs ---------------------------------------------------------------------------


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


# ---- responses and chunks ---------------------------------------------------------------------------------


def usage(finals: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass
class Formatter:
    """One request's response/chunk builder. `kind` is 'chat' or 'completion'; choice index = prompt * n + j."""

    kind: str
    model: str
    n: int
    texts: TokenTexts
    logprobs_k: int | None
    prompts: list[Prompt]
    echo: bool = False
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    # stream state
    _started: set[int] = field(default_factory=set)
    _finished: set[int] = field(default_factory=set)
    _offsets: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.id = self.id or new_id("chatcmpl" if self.kind == "chat" else "cmpl")

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def index(self, prompt_idx: int, c: CompletionOutput) -> int:
        return prompt_idx * self.n + c.index

    def _logprobs(self, lps: list[TokenLogprob] | None, offset: int) -> dict[str, Any] | None:
        if self.logprobs_k is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(self.texts, lps or [], self.logprobs_k)
        return completion_logprobs(self.texts, lps or [], self.logprobs_k, offset)

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for p, out in enumerate(finals):
            for c in out.outputs:
                prefix = self.prompts[p].text if self.echo else ""
                choice: dict[str, Any] = {"index": self.index(p, c)}
                if self.kind == "chat":
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    choice["text"] = prefix + c.text
                choice["logprobs"] = self._logprobs(c.logprobs, len(prefix))
                choice["finish_reason"] = c.finish_reason
                choice["stop_reason"] = c.stop_reason
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(finals),
        }

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: only the last chunk carries usage
        return chunk

    def chunks(self, prompt_idx: int, out: RequestOutput) -> list[dict[str, Any]]:
        """The chunks for one engine yield: a role chunk first per chat choice, then deltas and finishes."""
        result = []
        for c in out.outputs:
            i = self.index(prompt_idx, c)
            if i in self._finished:
                continue
            text = c.delta_text or ""
            if i not in self._started:
                self._started.add(i)
                if self.kind == "chat":
                    result.append(
                        self._chunk(
                            [
                                {
                                    "index": i,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
                    )
                elif self.echo:
                    text = self.prompts[prompt_idx].text + text
            if not text and not c.delta_token_ids and c.finish_reason is None:
                continue
            offset = self._offsets.get(i, len(self.prompts[prompt_idx].text) if self.echo else 0)
            choice: dict[str, Any] = {"index": i}
            if self.kind == "chat":
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text
            choice["logprobs"] = self._logprobs(c.delta_logprobs, offset) if c.delta_token_ids else None
            choice["finish_reason"] = c.finish_reason
            if c.finish_reason is not None:
                choice["stop_reason"] = c.stop_reason
                self._finished.add(i)
            self._offsets[i] = offset + len(c.delta_text or "")
            result.append(self._chunk([choice]))
        return result

    def usage_chunk(self, finals: list[RequestOutput]) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage(finals)
        return chunk
