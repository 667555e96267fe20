"""What the engine hands out per step: cumulative fields plus delta_* since the previous output."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestMetrics:
    # time.time() stamps; queue time = first_scheduled - arrival, TTFT = first_token - arrival
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # stop | length | abort | None while running
    stop_reason: str | int | None  # the stop string or stop token id that ended it; None for EOS/length
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # echo with logprobs: one per prompt token, None for the first; complete once the prompt is prefilled
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EngineStats:
    """Counters (monotonic) and gauges for /metrics."""

    running: int
    waiting: int
    kv_usage: float
    free_blocks: int
    total_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found cached
    num_preemptions: int
    prompt_tokens_total: int  # prompt tokens computed (recomputation after preemption included)
    generation_tokens_total: int
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    num_requests_failed: int = 0


@dataclass
class Capacity:
    num_blocks: int
    block_size: int
    tokens: int
    max_model_len_seqs: float  # how many sequences of max_model_len fit at once
