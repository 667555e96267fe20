"""OpenAI requests -> prompt token ids + SamplingParams; RequestOutputs -> OpenAI responses and stream chunks.

Pure functions and small formatters over plain data: no HTTP, no engine calls, so every shape is testable alone.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from llmdeploy.engine.chat import chat_prompt_ids, text_prompt_ids
from llmdeploy.engine.errors import CapacityError, ContextLengthError, ParamError
from llmdeploy.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from llmdeploy.engine.sampling_params import SamplingParams
from llmdeploy.engine.structured import guided_spec, logit_bias, tool_dicts, tool_plan
from llmdeploy.engine.token_texts import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    joined_logprobs,
)
from llmdeploy.engine.tool_calls import ToolPlan, ToolStreamer, parse_output
from llmdeploy.engine.tool_calls import finish_reason as tool_finish_reason
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


@dataclass
class Prompt:
    """One engine request and how its outputs are read back."""

    token_ids: list[int]
    text: str  # what `echo` prepends
    tools: ToolPlan | None = None  # chat with tools: the output may hold tool calls
    best_of: int | None = None  # completions: the engine makes this many, the best n are answered


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- requests ---------------------------------------------------------------------------------------------


def chat_prompts(tokenizer: Any, req: ChatCompletionRequest) -> list[Prompt]:
    plan = tool_plan(req, tokenizer)
    tools = tool_dicts(req) if plan is not None else None
    return [Prompt(chat_prompt_ids(tokenizer, req.messages, tools), "", tools=plan)]


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
    vocab = len(tokenizer)
    for item in raw:
        if isinstance(item, str):
            prompts.append(Prompt(text_prompt_ids(tokenizer, item), item))
        elif any(t < 0 or t >= vocab for t in item):  # before decode (echo): it overflows on huge ids
            raise invalid_request(f"Prompt token ids must be in [0, {vocab}).", param="prompt")
        else:
            prompts.append(Prompt(list(item), tokenizer.decode(item) if req.echo else ""))
    if req.best_of is not None and req.best_of > req.n:
        for pr in prompts:
            pr.best_of = req.best_of
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
    best_of = getattr(req, "best_of", None) or req.n
    if best_of > req.n and logprobs is None:
        logprobs = 0  # the best are chosen by their total logprob; not shown unless asked for
    return SamplingParams(
        n=best_of,
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
        prompt_logprobs=logprobs if getattr(req, "echo", False) else None,
        skip_special_tokens=_extra(req, "skip_special_tokens", True),
        include_stop_str_in_output=_extra(req, "include_stop_str_in_output", False),
        logit_bias=logit_bias(req),
        guided=guided_spec(req),
    )


def chat_logprobs_k(req: ChatCompletionRequest) -> int | None:
    return (req.top_logprobs or 0) if req.logprobs else None


def completion_logprobs_k(req: CompletionRequest) -> int | None:
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
    _streamers: dict[int, ToolStreamer] = field(default_factory=dict)

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
            for c in self._best(p, out.outputs):
                prefix = self.prompts[p].text if self.echo else ""
                choice: dict[str, Any] = {"index": self.index(p, c)}
                reason = c.finish_reason
                if self.kind == "chat":
                    choice["message"], reason = self._message(p, c)
                else:
                    choice["text"] = prefix + c.text
                choice["logprobs"] = self._logprobs(c.logprobs, len(prefix))
                if self.echo and self.logprobs_k is not None and out.prompt_logprobs is not None:
                    choice["logprobs"] = self._with_prompt(out, choice["logprobs"])
                choice["finish_reason"] = reason
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

    def _with_prompt(self, out: RequestOutput, generated: dict[str, Any] | None) -> dict[str, Any]:
        """echo with logprobs: the prompt tokens' logprobs in front of the generated ones'."""
        assert self.logprobs_k is not None and out.prompt_logprobs is not None
        prompt = echo_logprobs(self.texts, out.prompt_token_ids, out.prompt_logprobs, self.logprobs_k)
        return joined_logprobs(prompt, generated)

    def _best(self, p: int, outputs: list[CompletionOutput]) -> list[CompletionOutput]:
        """best_of: the n outputs with the highest total logprob, renumbered 0..n-1 (vLLM's rule)."""
        if not self.prompts[p].best_of:
            return outputs
        ranked = sorted(outputs, key=lambda c: -sum(lp.logprob for lp in c.logprobs or []))[: self.n]
        return [replace(c, index=j) for j, c in enumerate(ranked)]

    def _message(self, p: int, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        plan = self.prompts[p].tools
        if plan is None:
            return {"role": "assistant", "content": c.text}, c.finish_reason
        parsed = parse_output(plan, c.text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = [call.as_openai() for call in parsed.tool_calls]
        return message, tool_finish_reason(parsed, c.finish_reason)

    def _tool_chunks(self, i: int, plan: ToolPlan, c: CompletionOutput, text: str) -> list[dict[str, Any]]:
        """A choice whose output may hold tool calls: content and call deltas as OpenAI streams them."""
        streamer = self._streamers.setdefault(i, ToolStreamer(plan))
        done = c.finish_reason is not None
        out = [
            self._chunk([{"index": i, "delta": d, "logprobs": None, "finish_reason": None}])
            for d in streamer.feed(text, done)
        ]
        if done:
            reason = streamer.finish_reason(c.finish_reason)
            end = {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}
            out.append(self._chunk([{**end, "stop_reason": c.stop_reason}]))
            self._finished.add(i)
        return out

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
        result, echoed = [], set()
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
                    echoed.add(i)
            if not text and not c.delta_token_ids and c.finish_reason is None:
                continue
            plan = self.prompts[prompt_idx].tools if self.kind == "chat" else None
            if plan is not None:
                result += self._tool_chunks(i, plan, c, text)
                continue
            offset = self._offsets.get(i, len(self.prompts[prompt_idx].text) if self.echo else 0)
            choice: dict[str, Any] = {"index": i}
            if self.kind == "chat":
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text
            choice["logprobs"] = self._logprobs(c.delta_logprobs, offset) if c.delta_token_ids else None
            if i in echoed and self.logprobs_k is not None and out.prompt_logprobs is not None:
                choice["logprobs"] = self._with_prompt(out, choice["logprobs"])
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
