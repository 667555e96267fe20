"""What one request did, as the client saw it: the record every summary, verdict and burst count is built from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmdeploy.loadgen.workload import PromptKind

LoadMode = Literal["concurrency", "rate"]
TokenSource = Literal["usage", "chunks", "words", "none"]
UNKNOWN_BACKEND = "unknown"  # no x-llmdeploy-backend header: the server is not llmdeploy's router
REJECT_STATUSES = (429, 503)  # "too busy, come back later": the server refused rather than failed


@dataclass(frozen=True)
class RequestResult:
    arrival_s: (
        float  # when the request was due, from the start of its level (open loop: its scheduled arrival)
    )
    end_s: float  # last byte, or the error
    ok: bool
    kind: PromptKind
    backend: str  # x-llmdeploy-backend: local | cloud | none (router errors) | unknown (header absent)
    status: int | None = None  # HTTP status; None when no response came (timeout, connection)
    error: str | None = None  # error kind, e.g. http_429:rate_limit_exceeded, timeout, connection
    ttft_s: float | None = None  # first content chunk; None without streaming (a client sees no first token)
    output_tokens: int = 0
    prompt_tokens: int | None = None  # usage.prompt_tokens when the server sent usage
    token_source: TokenSource = "none"
    phase: str = ""  # burst drill: before | burst | after

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """(end - first token) / (tokens - 1), as vLLM's benchmark computes it; None under 2 tokens."""
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return max(0.0, self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def rejected(self) -> bool:
        return self.status in REJECT_STATUSES


@dataclass(frozen=True)
class LoadPoint:
    mode: LoadMode
    value: float

    @property
    def label(self) -> str:
        return f"concurrency {self.value:g}" if self.mode == "concurrency" else f"rate {self.value:g}/s"
