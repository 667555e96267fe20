"""Can a local replica take this request now and still meet the SLA? If not, why (the metrics label).

Overflow happens *before queueing*, judged on the engine's own /load state plus the router's in-flight count
(which is current even when the last /load poll is a few hundred milliseconds old).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmdeploy.policies.snapshot import EngineLoad, ReplicaState

# reason labels (metric `overflow_total{reason}`)
PREDICTED_TTFT = "predicted_ttft"
KV_BLOCKS = "kv_blocks"
QUEUE_DEPTH = "queue_depth"
BURST = "burst"
LOCAL_DOWN = "local_down"
REASONS = (PREDICTED_TTFT, KV_BLOCKS, QUEUE_DEPTH, BURST, LOCAL_DOWN)


@dataclass(frozen=True)
class OverflowLimits:
    ttft_p99_ms: float
    max_queue_depth: int
    use_predicted_ttft: bool = True

    @classmethod
    def from_spec(cls, spec) -> OverflowLimits:
        o = spec.routing.overflow
        return cls(spec.sla.ttft_p99_ms, o.max_queue_depth, o.use_predicted_ttft)


def queued_ahead(load: EngineLoad, inflight: int) -> int:
    """Requests that would wait before this one: the engine's queue, or what the router's own in-flight
    count implies when the engine's batch is full (the /load poll may lag)."""
    by_router = inflight - load.max_num_seqs if load.max_num_seqs > 0 else 0
    return max(load.waiting, by_router, 0)


def would_queue(load: EngineLoad, inflight: int) -> bool:
    occupants = max(load.running + load.waiting, inflight)
    return load.waiting > 0 or (load.max_num_seqs > 0 and occupants >= load.max_num_seqs)


def predicted_ttft_ms(load: EngineLoad, prompt_tokens: int) -> float:
    prefill_ms = prompt_tokens / load.prefill_tokens_per_s * 1000.0 if load.prefill_tokens_per_s > 0 else 0.0
    return load.predicted_queue_wait_ms + prefill_ms


def blocks_needed(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / max(1, block_size))


def overflow_reason(
    replica: ReplicaState, prompt_tokens: int, max_tokens: int, limits: OverflowLimits
) -> str | None:
    """None: this replica can take the request now; else the reason label. Burst is judged separately
    (it is about the arrival rate, not one replica)."""
    load = replica.load
    if not replica.usable or load is None:
        return LOCAL_DOWN
    if would_queue(load, replica.inflight) and queued_ahead(load, replica.inflight) >= limits.max_queue_depth:
        return QUEUE_DEPTH
    if (
        load.total_blocks > 0
        and blocks_needed(prompt_tokens + max_tokens, load.block_size) > load.free_blocks
    ):
        return KV_BLOCKS
    if limits.use_predicted_ttft and predicted_ttft_ms(load, prompt_tokens) > limits.ttft_p99_ms:
        return PREDICTED_TTFT
    return None


def load_score(replica: ReplicaState) -> tuple[float, float]:
    """Smaller is less loaded: occupants (engine's view or the router's in-flight), then KV usage."""
    load = replica.load or EngineLoad()
    return (max(load.running + load.waiting, replica.inflight), load.kv_usage)


def least_loaded(replicas: list[ReplicaState] | tuple[ReplicaState, ...]) -> list[ReplicaState]:
    """Usable replicas, least loaded first (ties keep table order)."""
    return sorted((r for r in replicas if r.usable), key=load_score)
