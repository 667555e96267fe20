"""SamplingParams: OpenAI/vLLM sampling fields; validate() names the OpenAI param of a bad value."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmdeploy.engine.errors import ParamError
from llmdeploy.engine.guided import GuidedSpec

MAX_LOGPROBS = 20
# OpenAI documents `seed` as a 64-bit signed integer; torch.manual_seed overflows (a 500) outside about this range
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 forces it
GREEDY_EPS = 1e-5  # temperatures below this are greedy (dividing by them only overflows)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's logprob plus the top k
    prompt_logprobs: int | None = None  # echo with logprobs: each prompt token's logprob plus the top k
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's logit_bias)
    guided: GuidedSpec | None = None  # constrained decoding: the output matches this grammar

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self) -> SamplingParams:
        checks = [
            ("n", isinstance(self.n, int) and self.n >= 1, "must be an integer >= 1"),
            ("temperature", 0 <= self.temperature <= 100, "must be between 0 and 100"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            (
                "top_k",
                isinstance(self.top_k, int) and self.top_k >= -1,
                "must be -1 (off) or a positive integer",
            ),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            (
                "seed",
                self.seed is None
                or (
                    isinstance(self.seed, int)
                    and not isinstance(self.seed, bool)
                    and SEED_MIN <= self.seed <= SEED_MAX
                ),
                f"must be an integer in [{SEED_MIN}, {SEED_MAX}]",
            ),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be between -2 and 2"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be between -2 and 2"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 10, "must be in (0, 10]"),
            (
                "max_tokens",
                self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                "must be an integer >= 1",
            ),
            (
                "min_tokens",
                isinstance(self.min_tokens, int) and self.min_tokens >= 0,
                "must be an integer >= 0",
            ),
            (
                "min_tokens",
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                "stop",
                all(isinstance(s, str) and s for s in self.stop),
                "stop sequences must be non-empty strings",
            ),
            (
                "stop_token_ids",
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "must be non-negative token ids",
            ),
            (
                "logprobs",
                self.logprobs is None
                or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
                f"must be between 0 and {MAX_LOGPROBS}",
            ),
            (
                "logprobs",
                self.prompt_logprobs is None
                or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                f"must be between 0 and {MAX_LOGPROBS}",
            ),
            (
                "logit_bias",
                self.logit_bias is None
                or all(
                    isinstance(t, int) and t >= 0 and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                    for t, b in self.logit_bias.items()
                ),
                f"token ids must be >= 0 and biases between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}",
            ),
            (
                "ignore_eos",
                not (self.ignore_eos and self.guided is not None),
                "cannot be combined with constrained decoding (the grammar ends the output)",
            ),
        ]
        for param, ok, message in checks:
            if not ok:
                raise ParamError(
                    param, f"Invalid value for '{param}': {message} (got {getattr(self, param)!r})."
                )
        return self
