"""Plain data the policies decide over: what the router knows at the moment a request arrives.

The router builds these from the engines' /load JSON, its own in-flight counts and breaker states; policies
only read them, so every decision is a pure function testable without a server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineLoad:
    """An engine's /load JSON (docs/CONTRACTS.md section 4); missing keys take neutral defaults."""

    waiting: int = 0
    running: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 16
    pending_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    predicted_queue_wait_ms: float = 0.0
    kv_usage: float = 0.0
    max_model_len: int = 0
    max_num_seqs: int = 0
    num_preemptions: int = 0
    ready: bool = True

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineLoad:
        kwargs: dict[str, Any] = {}
        for name, f in cls.__dataclass_fields__.items():
            if name not in data or data[name] is None:
                continue
            caster = {"int": int, "float": float, "bool": bool}[str(f.type)]
            kwargs[name] = caster(data[name])
        return cls(**kwargs)


@dataclass(frozen=True)
class ReplicaState:
    """One engine replica as routing sees it: fresh load (None: unreachable), in-flight count, breaker."""

    url: str
    replica: str
    revision: int
    load: EngineLoad | None
    inflight: int = 0
    breaker_allows: bool = True
    listed_ready: bool = True

    @property
    def usable(self) -> bool:
        return self.listed_ready and self.breaker_allows and self.load is not None and self.load.ready


@dataclass(frozen=True)
class RevisionState:
    revision: int
    role: str  # "stable" | "candidate"
    percent: float
    replicas: tuple[ReplicaState, ...] = ()

    @property
    def ready(self) -> bool:
        return any(r.usable for r in self.replicas)


@dataclass(frozen=True)
class RequestFacts:
    """What the router knows about one request before sending it anywhere."""

    prompt_tokens: int
    max_tokens: int
    key_name: str = "anonymous"
    key_allows_cloud: bool = True
    header_allows_cloud: bool = True
    sticky_value: str | None = None
    pinned_revision: int | None = None


@dataclass(frozen=True)
class WindowStats:
    """A revision's sliding window (docs/CONTRACTS.md section 5), judged by policies.rollback."""

    requests: int = 0
    errors: int = 0
    error_rate: float = 0.0
    ttft_p99_ms: float | None = None
    window_s: float = 60.0
