"""Can a local replica take this request now and still meet the SLA? If not, why (the metrics label).

Overflow happens *before queueing*, judged on the engine's own /load state plus the router's in-flight count
(which is current even when the last /load poll is a few hundred milliseconds old).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmdeploy.policies.deadline import ttft_target_s
from llmdeploy.policies.snapshot import EngineLoad, ReplicaState, RequestFacts

# reason labels (metric `overflow_total{reason}`)
PREDICTED_TTFT = "predicted_ttft"
TPOT = "tpot"
KV_BLOCKS = "kv_blocks"
QUEUE_DEPTH = "queue_depth"
BURST = "burst"
LOCAL_DOWN = "local_down"
REASONS = (PREDICTED_TTFT, TPOT, KV_BLOCKS, QUEUE_DEPTH, BURST, LOCAL_DOWN)


@dataclass(frozen=True)
class OverflowLimits:
    ttft_p99_ms: float
    max_queue_depth: int
    use_predicted_ttft: bool = True
    tpot_p99_ms: float | None = None  # None: TPOT is not judged
    max_wait_ms: float | None = None  # a request that may not spill and would wait longer is shed (503)

    @classmethod
    def from_spec(cls, spec) -> OverflowLimits:
        o = spec.routing.overflow
        return cls(
            spec.sla.ttft_p99_ms,
            o.max_queue_depth,
            o.use_predicted_ttft,
            spec.sla.tpot_p99_ms,
            spec.routing.local_wait_s * 1000.0,
        )


def queued_ahead(load: EngineLoad, inflight: int) -> int:
    """Requests that would wait before this one: the engine's queue, or what the router's own in-flight
    count implies when the engine's batch is full (the /load poll may lag)."""
    by_router = inflight - load.max_num_seqs if load.max_num_seqs > 0 else 0
    return max(load.waiting, by_router, 0)


def would_queue(load: EngineLoad, inflight: int) -> bool:
    occupants = max(load.running + load.waiting, inflight)
    return load.waiting > 0 or (load.max_num_seqs > 0 and occupants >= load.max_num_seqs)


def unseen_requests(load: EngineLoad, inflight: int) -> int:
    """Requests this router sent that the engine's last /load did not count yet (the poll lags a little)."""
    return max(0, inflight - (load.running + load.waiting))


def predicted_ttft_ms(load: EngineLoad, prompt_tokens: int, inflight: int = 0) -> float:
    """The engine's own prediction for this prompt length under its queue, the requests sent since its last
    /load counted as prompts of the same size ahead of this one. Engines without a prediction: the queue wait
    plus the prompt at the reported prefill rate."""
    unseen = unseen_requests(load, inflight)
    if load.ttft_ms_by_prompt_len:
        return interpolate(load.ttft_ms_by_prompt_len, prompt_tokens * (1 + unseen))
    prefill_ms = prompt_tokens / load.prefill_tokens_per_s * 1000.0 if load.prefill_tokens_per_s > 0 else 0.0
    return load.predicted_queue_wait_ms + prefill_ms * (1 + unseen)


def interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise-linear through ascending points; linear beyond the last two (the first one's value below)."""
    if x <= points[0][0] or len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def ttft_target_ms(load: EngineLoad, prompt_tokens: int, ttft_p99_ms: float) -> float:
    """The SLA, or for a prompt whose own prefill alone exceeds it the engine's scaled deadline for it (the same
    rule the engine schedules by): else every such prompt would spill, even to an idle engine."""
    return ttft_target_s(load.step_cost, prompt_tokens, ttft_p99_ms / 1e3) * 1e3


def predicted_tpot_ms(load: EngineLoad, inflight: int = 0) -> float | None:
    """Time per output token once this request joins the running batch: one decode step at the larger batch
    (everyone decoding, queued or unseen, plus this one, up to the slot limit). None: the engine gives no model."""
    if load.step_cost is None:
        return None
    batch = load.decoding + load.waiting + unseen_requests(load, inflight) + 1
    if load.max_num_seqs > 0:
        batch = min(batch, load.max_num_seqs)
    cost = load.step_cost
    return cost.conservative(cost.decode_step_s(batch)) * 1000.0


def prompt_tokens_on(replica: ReplicaState, facts: RequestFacts) -> int:
    """The request's prompt tokens as this replica's tokenizer and chat template would make them (estimated)."""
    size = replica.load.prompt_size if replica.load is not None else None
    if size is None or facts.prompt is None:
        return facts.prompt_tokens
    return size.tokens(facts.prompt)


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
    if limits.use_predicted_ttft:
        target_ms = ttft_target_ms(load, prompt_tokens, limits.ttft_p99_ms)
        if predicted_ttft_ms(load, prompt_tokens, replica.inflight) > target_ms:
            return PREDICTED_TTFT
    if limits.tpot_p99_ms is not None:
        tpot = predicted_tpot_ms(load, replica.inflight)
        if tpot is not None and tpot > limits.tpot_p99_ms:
            return TPOT
    return None


def load_score(replica: ReplicaState) -> tuple[float, float]:
    """Smaller is less loaded: occupants (engine's view or the router's in-flight), then KV usage."""
    load = replica.load or EngineLoad()
    return (max(load.running + load.waiting, replica.inflight), load.kv_usage)


def least_loaded(replicas: list[ReplicaState] | tuple[ReplicaState, ...]) -> list[ReplicaState]:
    """Usable replicas, least loaded first (ties keep table order)."""
    return sorted((r for r in replicas if r.usable), key=load_score)
