"""Offline API: `LLM(model=..., **EngineConfig fields).generate(prompts, params)` and `.chat(conversations, params)`."""

from __future__ import annotations

from itertools import count
from typing import Any

from llmdeploy.engine.config import EngineConfig
from llmdeploy.engine.llm_engine import LLMEngine
from llmdeploy.engine.outputs import RequestOutput
from llmdeploy.engine.sampling_params import SamplingParams

Prompts = str | list[str] | list[int] | list[list[int]]


class LLM:
    def __init__(self, model: str, **kwargs: Any):
        config, unknown = EngineConfig.from_kwargs(model=model, **kwargs)
        if unknown:
            raise TypeError(f"unknown LLM argument(s): {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(config, eager_grammar=False)  # built when a request first needs it
        self.engine.stream = False
        self.tokenizer = self.engine.tokenizer
        self._ids = count()

    def encode(self, prompts: Prompts) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        elif prompts and isinstance(prompts[0], int):
            prompts = [prompts]  # one prompt of token ids
        return [list(p) if not isinstance(p, str) else list(self.tokenizer.encode(p)) for p in prompts]

    def generate(
        self, prompts: Prompts, params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        token_ids = self.encode(prompts)
        return self.generate_ids(token_ids, params)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_ids = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
            token_ids.append(
                list(self.tokenizer.encode(text, add_special_tokens=False))
            )  # the template has them
        return self.generate_ids(token_ids, params)

    def generate_ids(
        self, token_ids: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(token_ids)
        assert len(per_prompt) == len(token_ids), "one SamplingParams per prompt"
        for ids, p in zip(token_ids, per_prompt, strict=True):
            self.engine.check_request(ids, p)  # all or nothing: a bad prompt raises before any runs
        rids = [f"llm-{next(self._ids)}" for _ in token_ids]
        for rid, ids, p in zip(rids, token_ids, per_prompt, strict=True):
            self.engine.add_request(rid, ids, p, check=False)
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(rids) and self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                for _rid, exc in self.engine.pop_failures():
                    raise exc
        finally:
            for rid in rids:
                if rid not in done:
                    self.engine.abort(rid)
        missing = [r for r in rids if r not in done]
        if missing:
            raise RuntimeError(f"the engine stopped without finishing {len(missing)} request(s)")
        return [done[r] for r in rids]
