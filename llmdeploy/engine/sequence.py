"""A Sequence is one completion stream: prompt + generated token ids, its KV block table and its progress.

`num_computed_tokens` counts tokens whose K/V are in the cache; a step computes the rest (a prefill chunk, or the
one token sampled last step). Pure Python: the scheduler and block manager are tested without a model.
"""

from __future__ import annotations

from enum import Enum, auto
from itertools import count
from typing import Any

from llmdeploy.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(
        self, token_ids: list[int], params: SamplingParams | None = None, request_id: str = "", index: int = 0
    ):
        self.seq_id = next(Sequence._ids)
        self.request_id, self.index = request_id, index
        self.params = params or SamplingParams()
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at the first admission (reported to the client)
        self.block_table: list[int] = []
        self.block_hashes: list[
            int
        ] = []  # chained hashes of the full blocks of token_ids (memo; tokens only grow)
        self.num_registered_blocks = 0  # leading blocks already in (or found in) the prefix cache
        self.status = SequenceStatus.WAITING
        self.num_forks = (
            self.params.n - 1 if index == 0 else 0
        )  # siblings made when the prompt's prefill ends
        self.arrival_step = 0
        self.starved_steps = 0  # scheduler steps in a row without prefill progress (aging)
        self.admitted_once = False
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # per-sequence state of the engine (sampling stream, detokenizer, logprobs); opaque here
        self.generator: Any = None
        self.detok: Any = None
        self.logprobs: list | None = [] if self.params.logprobs is not None else None
        # the first prompt token has no logprob (nothing precedes it): None in its place, as OpenAI answers
        self.prompt_logprobs: list | None = [None] if self.params.prompt_logprobs is not None else None
        self.guided: Any = None  # engine.guided.GuidedState: this sequence's place in its grammar

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, {self.request_id}#{self.index}, len={len(self)}, computed={self.num_computed_tokens})"

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def max_len(self) -> int | None:
        """prompt + max_tokens (None: bounded by max_model_len only)."""
        mt = self.params.max_tokens
        return None if mt is None else self.num_prompt_tokens + mt

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork(self, index: int) -> Sequence:
        """A sibling with the same tokens and progress; the block manager shares the blocks."""
        child = Sequence(self.token_ids, self.params, self.request_id, index)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.block_hashes = list(self.block_hashes)
        child.num_registered_blocks = self.num_registered_blocks
        child.arrival_step, child.admitted_once = self.arrival_step, True
        child.status = SequenceStatus.RUNNING
        child.guided = self.guided.fork() if self.guided is not None else None
        return child
