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
from llmdeploy.engine.config import EngineConfig
from llmdeploy.engine.detokenizer import Detokenizer
from llmdeploy.engine.errors import ParamError, RequestFailedError
from llmdeploy.engine.load_stats import RateMeter
from llmdeploy.engine.loader import LoadedModel
from llmdeploy.engine.model_runner import ModelRunner
from llmdeploy.engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from llmdeploy.engine.sampler import Sampler
from llmdeploy.engine.sampling_params import SamplingParams
from llmdeploy.engine.scheduler import ScheduledBatch, Scheduler, long_prefill_limits
from llmdeploy.engine.sequence import Sequence

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
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.prefix_caching)
        long = long_prefill_limits(config.max_num_batched_tokens, self.runner.rates.prefill_s_per_token)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.runner.max_model_len,
            attn_cost_context=self.runner.attn_cost_context,
            long_prefill_threshold=long.threshold,
            long_prefill_budget=long.budget,
            long_prefill_budget_alone=long.budget_alone,
        )
        self.sampler = Sampler(config.seed, self.runner.device)
        self.rates = RateMeter(self.runner.rates.prefill_s_per_token, self.runner.rates.decode_step_s)
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
        if params.seed is not None:
            seq.generator = self.sampler.make_generator(params.seed)
        req = Request(
            request_id, list(prompt_token_ids), params, [seq], RequestMetrics(arrival_time or time.time())
        )
        with self.lock:
            if request_id in self.requests:
                raise ParamError("request_id", f"Request id {request_id!r} is already in use.")
            self.requests[request_id] = req
            self.scheduler.add(seq)

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
        t0 = time.perf_counter()
        try:
            logits = self.runner.run(batch)
            tokens, logprobs = self.sampler(logits, batch.samples, self.arch.eos_token_ids)
        except Exception as exc:  # a model error fails this batch's requests; the engine keeps serving
            log.exception("step failed; failing %d request(s)", len({s.request_id for s, _ in batch.samples}))
            with self.lock:
                self._fail_batch(batch, exc)
            return []
        step_s = time.perf_counter() - t0
        with self.lock:
            self.scheduler.postprocess(batch)
            self.rates.observe(batch.num_prefill_tokens, len(batch.decodes), step_s)
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
        cached = req.seqs[0].num_cached_tokens
        return RequestOutput(req.request_id, req.prompt_token_ids, outs, finished, cached, _copy(req.metrics))

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
        with self.lock:
            sch, bm = self.scheduler, self.block_manager
            pending = sch.pending_prefill_tokens()
            slots_full = sum(sch.slots(s) for s in sch.running) >= sch.max_num_seqs
            remaining = [(s.max_len or self.runner.max_model_len) - len(s) for s in sch.running]
            wait_s = self.rates.predicted_wait_s(
                pending, slots_full and bool(sch.waiting), min(remaining, default=0)
            )
            stats = self.stats()
            return {
                "waiting": stats.waiting,
                "running": stats.running,
                "free_blocks": bm.num_free_blocks,
                "total_blocks": bm.num_blocks,
                "block_size": bm.block_size,
                "pending_prefill_tokens": pending,
                "prefill_tokens_per_s": round(self.rates.prefill_tokens_per_s, 1),
                "decode_tokens_per_s": round(
                    self.rates.decode_tokens_per_s or 1.0 / self.rates.decode_step_s, 1
                ),
                "predicted_queue_wait_ms": round(wait_s * 1000.0, 1),
                "kv_usage": round(bm.usage, 4),
                "max_model_len": self.runner.max_model_len,
                "max_num_seqs": sch.max_num_seqs,
                "num_preemptions": sch.num_preemptions,
                "ready": ready,
            }


def _copy(m: RequestMetrics) -> RequestMetrics:
    return RequestMetrics(
        m.arrival_time,
        m.first_scheduled_time,
        m.first_token_time,
        m.last_token_time,
        m.finished_time,
        m.num_preemptions,
    )
