"""The engine's /load JSON (docs/CONTRACTS.md section 4): queue, KV room, the step-cost model and the predicted
TTFT by prompt length under the current queue. Read under the engine's lock."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmdeploy.engine.resources import process_usage
from llmdeploy.engine.scheduler import Scheduler
from llmdeploy.engine.ttft_model import PendingPrompt, QueueView, deadline_ladder, ttft_by_class, ttft_ladder
from llmdeploy.policies.step_cost import StepCost

if TYPE_CHECKING:
    from llmdeploy.engine.llm_engine import LLMEngine


def queue_view(sch: Scheduler, cost: StepCost, max_model_len: int, step_remaining_s: float) -> QueueView:
    """The scheduler's state as the TTFT model reads it."""
    now = sch.clock()
    pending = tuple(
        PendingPrompt(s.num_uncomputed, s.num_computed_tokens, sch.is_long(s), sch.deadline(s) - now)
        for s in [*sch.waiting, *(s for s in sch.running if s.num_uncomputed > 1)]
    )
    decoding = sum(1 for s in sch.running if s.num_uncomputed <= 1)
    used = sum(sch.slots(s) for s in sch.running) + sum(sch.slots(s) for s in sch.waiting)
    remaining = [(s.max_len or max_model_len) - len(s) for s in sch.running]
    budget = sch.max_num_batched_tokens
    return QueueView(
        pending=pending,
        decoding=decoding,
        budget=budget,
        long_threshold=sch.long_prefill_threshold,
        long_budget=int(min(sch.long_prefill_budget or budget, budget)),
        long_budget_alone=int(min(sch.long_prefill_budget_alone, budget)),
        free_slots=max(0, sch.max_num_seqs - used),
        slot_wait_s=min(remaining, default=0) * cost.decode_step_s(max(1, decoding)),
        step_remaining_s=step_remaining_s,
        ttft_sla_s=sch.ttft_sla_s,
    )


def load_report(engine: LLMEngine, ready: bool) -> dict[str, Any]:
    sch, bm, runner = engine.scheduler, engine.block_manager, engine.runner
    max_model_len = runner.max_model_len
    cost = engine.cost.current()
    queue = engine.queue_view()
    stats = engine.stats()
    ladder = ttft_ladder(queue, cost, max_model_len)
    typical = cost.step_s(256.0) / 256.0
    # 0 only where the fit has no decode terms at all (a warm-up it could not solve): the meter keeps them otherwise
    decode_s = cost.decode_step_s(queue.decoding)
    return {
        "waiting": stats.waiting,
        "running": stats.running,
        "decoding": queue.decoding,
        "free_blocks": bm.num_free_blocks,
        "total_blocks": bm.num_blocks,
        "block_size": bm.block_size,
        "pending_prefill_tokens": sch.pending_prefill_tokens(),
        "prefill_tokens_per_s": round(1.0 / typical, 1) if typical > 0 else 0.0,
        "decode_tokens_per_s": round(max(1, queue.decoding) / decode_s, 1) if decode_s > 0 else 0.0,
        # before this prompt's own step starts: the 1-token prediction less an idle engine's step
        "predicted_queue_wait_ms": round(
            max(0.0, ladder[0][1] - cost.conservative(cost.step_s(1.0)) * 1e3), 1
        ),
        "ttft_ms_by_prompt_len": ladder,
        "ttft_sla_ms": round(sch.ttft_sla_s * 1e3, 1),
        "deadline_ms_by_prompt_len": deadline_ladder(queue, cost, max_model_len),
        "ttft_by_class": ttft_by_class(queue, cost, max_model_len),
        "step_cost": cost.to_json(),
        "prompt_size": engine.prompt_size.to_json(),
        "decode_step_ms_by_batch": {
            str(b): round(t * 1e3, 2) for b, t in sorted(engine.cost.decode_step_s.items())
        },
        "max_num_batched_tokens": sch.max_num_batched_tokens,
        "kv_usage": round(bm.usage, 4),
        "max_model_len": max_model_len,
        "max_num_seqs": sch.max_num_seqs,
        "num_preemptions": sch.num_preemptions,
        "ready": ready,
        "capabilities": engine.capabilities.to_json(),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "dtype_reason": runner.loaded.dtype_reason,
        "quantization": runner.loaded.quantization,
        "resources": process_usage(runner.device).to_json(),  # RSS, device memory: watermarks
    }
