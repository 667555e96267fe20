"""LLMEngine: requests in, RequestOutputs out, one step at a time (schedule -> forward -> sample -> detokenize).

Thread-safe: add_request/abort/load/stats may be called from another thread than step(); the lock is held only
while scheduling and post-processing, never during the forward, so an abort frees the request's blocks at once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace

from llmdeploy.engine.block_manager import BlockManager
from llmdeploy.engine.capabilities import engine_capabilities
from llmdeploy.engine.config import EngineConfig
from llmdeploy.engine.detokenizer import Detokenizer
from llmdeploy.engine.errors import ParamError, RequestFailedError
from llmdeploy.engine.guided import GrammarBackend
from llmdeploy.engine.load_stats import StepCostMeter
from llmdeploy.engine.loader import LoadedModel
from llmdeploy.engine.model_runner import ModelRunner
from llmdeploy.engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from llmdeploy.engine.prompt_size import measure_prompt_size
from llmdeploy.engine.resources import process_usage
from llmdeploy.engine.sampler import Sampler
from llmdeploy.engine.sampling_params import SamplingParams
from llmdeploy.engine.scheduler import ScheduledBatch, Scheduler
from llmdeploy.engine.sequence import Sequence
from llmdeploy.engine.ttft_model import PendingPrompt, QueueView, deadline_ladder, ttft_by_class, ttft_ladder
from llmdeploy.policies.step_cost import chunk_cost

log = logging.getLogger("llmdeploy.engine")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    emitted: dict[int, int] = field(default_factory=dict)  # seq index -> output tokens already handed out

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.runner = ModelRunner(config, loaded)
        # max_model_len as capped by the model's positions
        self.config = replace(config, max_model_len=self.runner.max_model_len)
        self.tokenizer, self.arch = self.runner.loaded.tokenizer, self.runner.arch
        self.eos_token_ids = set(self.arch.eos_token_ids)
        self.prompt_size = measure_prompt_size(self.tokenizer)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.prefix_caching)
        self.cost = StepCostMeter(self.runner.calibration, self.runner.attn_cost_context)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.runner.max_model_len,
            attn_cost_context=self.runner.attn_cost_context,
            cost=self.cost.current(),  # deadlines and long-prefill limits follow the live fit (step: set_cost)
            ttft_sla_s=config.ttft_sla_ms / 1e3,
        )
        self.sampler = Sampler(config.seed, self.runner.device)
        self.guided = GrammarBackend(self.tokenizer, self.arch.vocab_size, self.arch.eos_token_ids)
        self.capabilities = engine_capabilities(self.tokenizer, self.runner.max_model_len)
        self.step_started: float | None = None  # monotonic start of the step running now (None: idle)
        self.step_expected_s = 0.0
        self.requests: dict[str, Request] = {}
        self.lock = threading.RLock()
        self.stream = True  # build outputs of unfinished requests too (LLM.generate only needs the last one)
        self.failures: list[tuple[str, BaseException]] = []
        self.counters = dict(prompt=0, generation=0, finished=0, aborted=0, failed=0)

    @property
    def capacity(self):
        return self.runner.capacity

    # requests
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ParamError / ContextLengthError / CapacityError for what could never be served."""
        params.validate()
        self.guided.check(params)  # a bad schema or logit_bias token is a 400 before queueing
        if not prompt_token_ids:
            raise ParamError("prompt", "The prompt is empty.")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.arch.vocab_size:
            raise ParamError("prompt", f"Prompt token ids must be in [0, {self.arch.vocab_size}).")
        if params.n > self.scheduler.max_num_seqs:
            raise ParamError(
                "n", f"n={params.n} exceeds this engine's max_num_seqs ({self.scheduler.max_num_seqs})."
            )
        self.scheduler.check_fits(len(prompt_token_ids), params.max_tokens)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        check: bool = True,
    ) -> None:
        if check:
            self.check_request(prompt_token_ids, params)
        seq = Sequence(prompt_token_ids, params, request_id)
        if params.guided is not None:
            seq.guided = self.guided.new_state(params.guided)
        if params.seed is not None:
            seq.generator = self.sampler.make_generator(params.seed)
        req = Request(
            request_id, list(prompt_token_ids), params, [seq], RequestMetrics(arrival_time or time.time())
        )
        with self.lock:
            if request_id in self.requests:
                raise ParamError("request_id", f"Request id {request_id!r} is already in use.")
            self.requests[request_id] = req
            waited = max(0.0, time.time() - req.metrics.arrival_time)  # its deadline counts from its arrival
            self.scheduler.add(seq, arrival=self.scheduler.clock() - waited)

    def abort(self, request_id: str) -> bool:
        with self.lock:
            req = self.requests.pop(request_id, None)
            if req is None:
                return False
            for seq in req.seqs:
                self.scheduler.finish(seq, "abort")
            self.counters["aborted"] += 1
            return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def pop_failures(self) -> list[tuple[str, BaseException]]:
        with self.lock:
            failures, self.failures = self.failures, []
            return failures

    # one step
    def step(self) -> list[RequestOutput]:
        with self.lock:
            batch = self.scheduler.schedule()
            if batch.is_empty:
                return []
            self._on_scheduled(batch)
            attn = self.scheduler.attn_cost_context
            prefill_cost = sum(chunk_cost(s.num_computed_tokens, n, attn) for s, n in batch.prefills)
            self.step_expected_s = self.cost.current().step_s(prefill_cost, len(batch.decodes))
            self.step_started = t0 = time.perf_counter()
        try:
            logits = self.runner.run(batch)
            tokens, logprobs = self.sampler(logits, batch.samples, self.arch.eos_token_ids)
        except Exception as exc:  # a model error fails this batch's requests; the engine keeps serving
            log.exception("step failed; failing %d request(s)", len({s.request_id for s, _ in batch.samples}))
            with self.lock:
                self.step_started = None
                self._fail_batch(batch, exc)
            return []
        step_s = time.perf_counter() - t0
        with self.lock:
            self.step_started = None
            _record_prompt_logprobs(batch, self.runner.prompt_logprobs)
            self.scheduler.postprocess(batch)
            self.cost.observe(prefill_cost, len(batch.decodes), step_s)
            self.scheduler.set_cost(self.cost.current())
            return self._process(batch, tokens, logprobs)

    def _on_scheduled(self, batch: ScheduledBatch) -> None:
        now = time.time()
        for seq, _ in batch.prefills:
            req = self.requests[seq.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        for parent, child in batch.forks:
            req = self.requests[parent.request_id]
            if parent.generator is not None:
                child.generator = self.sampler.make_generator(req.params.seed + child.index)
            req.seqs.append(child)
        for seq in batch.preempted:
            self.requests[seq.request_id].metrics.num_preemptions += 1

    def _process(
        self, batch: ScheduledBatch, tokens: list[int], logprobs: list[TokenLogprob | None]
    ) -> list[RequestOutput]:
        now = time.time()
        touched: dict[str, Request] = {}
        for (seq, _), token, lp in zip(batch.samples, tokens, logprobs, strict=True):
            req = self.requests.get(seq.request_id)
            if req is None or seq.is_finished:
                continue  # aborted during the forward
            try:
                seq.append(token)
                if seq.guided is not None:
                    seq.guided.accept(token)  # the grammar follows the output (engine/guided.py)
                if lp is not None:
                    seq.logprobs.append(lp)
                reason = self._finish_reason(seq, token)
                if reason:
                    self.scheduler.finish(seq, reason)
            except Exception as exc:  # one request's processing failed: fail that request only
                log.exception("request %s failed in post-processing", req.request_id)
                self._fail(req, exc)
                continue
            touched[req.request_id] = req
            self.counters["generation"] += 1
        outputs = []
        for req in touched.values():
            m = req.metrics
            if m.first_token_time is None:
                m.first_token_time = now
                self.counters["prompt"] += len(req.prompt_token_ids)
            m.last_token_time = now
            finished = req.finished
            if finished:
                m.finished_time = now
                del self.requests[req.request_id]
                self.counters["finished"] += 1
            if finished or self.stream:
                outputs.append(self._output(req, finished))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.detok is None:
            seq.detok = Detokenizer(self.tokenizer, seq.token_ids[: seq.num_prompt_tokens], p)
        reason = None
        if token in self.eos_token_ids and not p.ignore_eos:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        else:
            seq.stop_reason = seq.detok.add_token(token, check_stop=seq.num_output_tokens >= p.min_tokens)
            if seq.stop_reason is not None:
                return "stop"  # the text is already cut at the stop string
        if reason is None and (
            (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens)
            or len(seq) >= self.runner.max_model_len
        ):
            reason = "length"
        if reason:
            seq.detok.flush()
        return reason

    def _output(self, req: Request, finished: bool) -> RequestOutput:
        outs = []
        for seq in sorted(req.seqs, key=lambda s: s.index):
            detok: Detokenizer | None = seq.detok
            delta_text = detok.emit(seq.is_finished) if detok else ""
            start = req.emitted.get(seq.index, 0)
            ids = seq.output_token_ids
            req.emitted[seq.index] = len(ids)
            lps = seq.logprobs
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=detok.output_text if detok else "",
                    token_ids=ids,
                    logprobs=list(lps) if lps is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    delta_text=delta_text,
                    delta_token_ids=ids[start:],
                    delta_logprobs=lps[start:] if lps is not None else None,
                )
            )
        first = req.seqs[0]
        prompt_lps = first.prompt_logprobs
        if prompt_lps is not None and len(prompt_lps) < first.num_prompt_tokens:
            prompt_lps = None  # the prompt is not all prefilled yet
        return RequestOutput(
            req.request_id,
            req.prompt_token_ids,
            outs,
            finished,
            first.num_cached_tokens,
            _copy(req.metrics),
            list(prompt_lps) if prompt_lps is not None else None,
        )

    def _fail(self, req: Request, exc: BaseException) -> None:
        self.requests.pop(req.request_id, None)
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")
        self.counters["failed"] += 1
        err = (
            exc
            if isinstance(exc, RequestFailedError)
            else RequestFailedError(f"request failed: {type(exc).__name__}: {exc}")
        )
        self.failures.append((req.request_id, err))

    def _fail_batch(self, batch: ScheduledBatch, exc: BaseException) -> None:
        ids = {s.request_id for s, _ in batch.prefills} | {s.request_id for s in batch.decodes}
        for rid in ids:
            req = self.requests.get(rid)
            if req is not None:
                self._fail(req, exc)

    # observability
    def stats(self) -> EngineStats:
        with self.lock:  # a consistent snapshot: /metrics scrapes from another thread than the step loop
            return self._stats()

    def _stats(self) -> EngineStats:
        bm, sch, c = self.block_manager, self.scheduler, self.counters
        return EngineStats(
            running=len({s.request_id for s in sch.running}),
            waiting=len({s.request_id for s in sch.waiting}),
            kv_usage=bm.usage,
            free_blocks=bm.num_free_blocks,
            total_blocks=bm.num_blocks,
            prefix_cache_queries=bm.num_queries,
            prefix_cache_hits=bm.num_hits,
            num_preemptions=sch.num_preemptions,
            prompt_tokens_total=c["prompt"],
            generation_tokens_total=c["generation"],
            num_requests_finished=c["finished"],
            num_requests_aborted=c["aborted"],
            num_requests_failed=c["failed"],
        )

    def load(self, ready: bool = True) -> dict:
        """The /load JSON (docs/CONTRACTS.md section 4): queue, KV room, the step-cost model and the predicted
        TTFT by prompt length under the current queue."""
        with self.lock:
            sch, bm = self.scheduler, self.block_manager
            cost = self.cost.current()
            queue = self.queue_view()
            stats = self._stats()
            ladder = ttft_ladder(queue, cost, self.runner.max_model_len)
            typical = cost.step_s(256.0) / 256.0
            return {
                "waiting": stats.waiting,
                "running": stats.running,
                "decoding": queue.decoding,
                "free_blocks": bm.num_free_blocks,
                "total_blocks": bm.num_blocks,
                "block_size": bm.block_size,
                "pending_prefill_tokens": sch.pending_prefill_tokens(),
                "prefill_tokens_per_s": round(1.0 / typical, 1) if typical > 0 else 0.0,
                "decode_tokens_per_s": round(max(1, queue.decoding) / cost.decode_step_s(queue.decoding), 1),
                # before this prompt's own step starts: the 1-token prediction less an idle engine's step
                "predicted_queue_wait_ms": round(
                    max(0.0, ladder[0][1] - cost.conservative(cost.step_s(1.0)) * 1e3), 1
                ),
                "ttft_ms_by_prompt_len": ladder,
                "ttft_sla_ms": round(sch.ttft_sla_s * 1e3, 1),
                "deadline_ms_by_prompt_len": deadline_ladder(queue, cost, self.runner.max_model_len),
                "ttft_by_class": ttft_by_class(queue, cost, self.runner.max_model_len),
                "step_cost": cost.to_json(),
                "prompt_size": self.prompt_size.to_json(),
                "decode_step_ms_by_batch": {
                    str(b): round(t * 1e3, 2) for b, t in sorted(self.cost.decode_step_s.items())
                },
                "max_num_batched_tokens": sch.max_num_batched_tokens,
                "kv_usage": round(bm.usage, 4),
                "max_model_len": self.runner.max_model_len,
                "max_num_seqs": sch.max_num_seqs,
                "num_preemptions": sch.num_preemptions,
                "ready": ready,
                "capabilities": self.capabilities.to_json(),
                "dtype": str(self.runner.dtype).removeprefix("torch."),
                "dtype_reason": self.runner.loaded.dtype_reason,
                "quantization": self.runner.loaded.quantization,
                "resources": process_usage(self.runner.device).to_json(),  # RSS, device memory: watermarks
            }

    def queue_view(self) -> QueueView:
        """The scheduler's state as the TTFT model reads it (under the lock)."""
        sch, now = self.scheduler, self.scheduler.clock()
        pending = tuple(
            PendingPrompt(s.num_uncomputed, s.num_computed_tokens, sch.is_long(s), sch.deadline(s) - now)
            for s in [*sch.waiting, *(s for s in sch.running if s.num_uncomputed > 1)]
        )
        decoding = sum(1 for s in sch.running if s.num_uncomputed <= 1)
        used = sum(sch.slots(s) for s in sch.running) + sum(sch.slots(s) for s in sch.waiting)
        remaining = [(s.max_len or self.runner.max_model_len) - len(s) for s in sch.running]
        cost = self.cost.current()
        in_progress = 0.0
        if self.step_started is not None:
            in_progress = max(0.0, self.step_expected_s - (time.perf_counter() - self.step_started))
        return QueueView(
            pending=pending,
            decoding=decoding,
            budget=sch.max_num_batched_tokens,
            long_threshold=sch.long_prefill_threshold,
            long_budget=int(
                min(sch.long_prefill_budget or sch.max_num_batched_tokens, sch.max_num_batched_tokens)
            ),
            long_budget_alone=int(min(sch.long_prefill_budget_alone, sch.max_num_batched_tokens)),
            free_slots=max(0, sch.max_num_seqs - used),
            slot_wait_s=min(remaining, default=0) * cost.decode_step_s(max(1, decoding)),
            step_remaining_s=in_progress,
            ttft_sla_s=sch.ttft_sla_s,
        )


def _record_prompt_logprobs(batch: ScheduledBatch, found: dict[int, list[TokenLogprob]]) -> None:
    """Append each chunk's prompt logprobs to its sequence, once per position (a preempted sequence computes its
    prompt again; what it had recorded stays)."""
    for seq, _ in batch.prefills:
        lps = found.get(seq.seq_id)
        if lps is None or seq.prompt_logprobs is None:
            continue
        first_position = seq.num_computed_tokens + 1  # before postprocess: where this chunk started, + 1
        have = len(seq.prompt_logprobs)
        if have >= first_position:
            seq.prompt_logprobs.extend(lps[have - first_position :])


def _copy(m: RequestMetrics) -> RequestMetrics:
    return RequestMetrics(
        m.arrival_time,
        m.first_scheduled_time,
        m.first_token_time,
        m.last_token_time,
        m.finished_time,
        m.num_preemptions,
    )
