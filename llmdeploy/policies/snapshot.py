"""Plain data the policies decide over: what the router knows at the moment a request arrives.

The router builds these from the engines' /load JSON, its own in-flight counts and breaker states; policies
only read them, so every decision is a pure function testable without a server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from llmdeploy.policies.capability import Capabilities, Needs
from llmdeploy.policies.prompt_size import PromptShape, PromptSize
from llmdeploy.policies.resources import ResourceUsage
from llmdeploy.policies.step_cost import StepCost

Role = Literal["stable", "candidate"]
BackendKind = Literal["local", "cloud"]


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
    decoding: int = 0
    max_num_batched_tokens: int = 0
    # predicted TTFT under the engine's queue, [[prompt tokens, ms], ...] ascending (engine/ttft_model.py)
    ttft_ms_by_prompt_len: tuple[tuple[float, float], ...] = ()
    step_cost: StepCost | None = None
    capabilities: Capabilities | None = None  # what the engine's model supports (policies/capability.py)
    prompt_size: PromptSize | None = None
    resources: ResourceUsage | None = None  # the engine process's memory watermarks (policies/resources.py)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineLoad:
        kwargs: dict[str, Any] = {}
        for name, f in cls.__dataclass_fields__.items():
            if name not in data or data[name] is None:
                continue
            caster = _CASTERS.get(str(f.type))
            if caster is not None:
                kwargs[name] = caster(data[name])
        kwargs["ttft_ms_by_prompt_len"] = _ladder(data.get("ttft_ms_by_prompt_len"))
        kwargs["step_cost"] = StepCost.from_json(data.get("step_cost"))
        kwargs["capabilities"] = Capabilities.from_json(data.get("capabilities"))
        kwargs["prompt_size"] = PromptSize.from_json(data.get("prompt_size"))
        kwargs["resources"] = ResourceUsage.from_json(data.get("resources"))
        return cls(**kwargs)


_CASTERS = {"int": int, "float": float, "bool": bool}


def _ladder(raw: Any) -> tuple[tuple[float, float], ...]:
    """A well-formed ascending ladder, or () (an older engine, or a malformed one: the fallback rule applies)."""
    if not isinstance(raw, list):
        return ()
    try:
        pts = tuple((float(n), float(ms)) for n, ms in raw)
    except (TypeError, ValueError):
        return ()
    ascending = all(a[0] < b[0] for a, b in zip(pts, pts[1:], strict=False))
    return pts if pts and ascending else ()


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
    role: Role
    percent: float
    replicas: tuple[ReplicaState, ...] = ()

    @property
    def ready(self) -> bool:
        return any(r.usable for r in self.replicas)


@dataclass(frozen=True)
class RequestFacts:
    """What the router knows about one request before sending it anywhere."""

    prompt_tokens: int  # estimated without an engine's tokenizer coefficients
    max_tokens: int
    key_name: str = "anonymous"
    key_allows_cloud: bool = True
    header_allows_cloud: bool = True
    sticky_value: str | None = None
    pinned_revision: int | None = None
    needs: Needs | None = None  # what the request asks of a backend (policies/capability.py)
    prompt: PromptShape | None = None  # for each engine's own estimate (prompt_tokens_on)
    prefix_key: str | None = None  # a hash of the prompt's reusable prefix (policies/affinity.py)


@dataclass(frozen=True)
class WindowStats:
    """A revision's sliding window (docs/CONTRACTS.md section 5), judged by policies.rollback."""

    requests: int = 0
    errors: int = 0
    error_rate: float = 0.0
    ttft_p99_ms: float | None = None
    window_s: float = 60.0
