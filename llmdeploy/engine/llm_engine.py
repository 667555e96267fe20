"""LLMEngine: requests in, RequestOutputs out, one step at a time (schedule -> forward -> sample -> detokenize).

Thread-safe: add_request/abort/load/stats may be called from another thread than step(); the lock is held only
while scheduling (with the step's inputs read from the block tables) and post-processing, never during the
forward, so an abort frees the request's blocks at once.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import replace

from llmdeploy.engine.block_manager import BlockManager
from llmdeploy.engine.capabilities import engine_capabilities
from llmdeploy.engine.config import EngineConfig
from llmdeploy.engine.detokenizer import Detokenizer
from llmdeploy.engine.errors import ParamError, RequestFailedError
from llmdeploy.engine.guided import GrammarBackend
from llmdeploy.engine.load_report import load_report, queue_view
from llmdeploy.engine.load_stats import StepCostMeter
from llmdeploy.engine.loader import LoadedModel
from llmdeploy.engine.model_runner import ModelRunner
from llmdeploy.engine.outputs import EngineStats, RequestMetrics, RequestOutput, TokenLogprob
from llmdeploy.engine.prompt_size import measure_prompt_size
from llmdeploy.engine.request import Request, record_prompt_logprobs
from llmdeploy.engine.sampler import Sampler, plain_greedy, plain_sampled
from llmdeploy.engine.sampling_params import SamplingParams
from llmdeploy.engine.scheduler import ScheduledBatch, Scheduler
from llmdeploy.engine.sequence import Sequence
from llmdeploy.engine.ttft_model import QueueView
from llmdeploy.kernels.decode_step import BurstDraw
from llmdeploy.policies.decode_burst import burst_allowed, burst_steps
from llmdeploy.policies.step_cost import chunk_cost

log = logging.getLogger("llmdeploy.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, eager_grammar: bool = True):
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
            self.config,
            attn_cost_context=self.runner.attn_cost_context,
            cost=self.cost.current(),  # deadlines and long-prefill limits follow the live fit (step: set_cost)
        )
        self.sampler = Sampler(config.seed, self.runner.device)
        self.guided = GrammarBackend(
            self.tokenizer, self.arch.vocab_size, self.arch.eos_token_ids, eager=eager_grammar
        )
        self.capabilities = engine_capabilities(self.tokenizer, self.runner.max_model_len)
        self.step_started: float | None = None  # monotonic start of the step running now (None: idle)
        self.step_shape = (0.0, 0)  # the running step's effective prefill tokens and decodes
        self.step_count = 1  # steps the running native call may take (policies/decode_burst.py)
        # set when a prompt arrives or a request is aborted: a running burst ends after its current step (the C
        # loop reads it between steps; cleared under the lock when a burst starts, with nobody waiting)
        self.burst_yield = ctypes.c_int32(0)
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
            self.scheduler.set_cost(self.cost.current())  # the fit as of now: its deadline is set by it
            self.scheduler.add(seq, arrival=self.scheduler.clock() - waited)
            self.burst_yield.value = 1

    def abort(self, request_id: str) -> bool:
        with self.lock:
            if self._remove(request_id) is None:
                return False
            self.burst_yield.value = 1
            self.counters["aborted"] += 1
            return True

    def _remove(self, request_id: str) -> Request | None:
        """Forget the request and free its sequences' blocks (under the lock)."""
        req = self.requests.pop(request_id, None)
        for seq in req.seqs if req is not None else ():
            self.scheduler.finish(seq, "abort")
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def fail(self, request_id: str, exc: BaseException) -> bool:
        """End the request with an error (pop_failures hands it out) and free its blocks; False if it is gone."""
        with self.lock:
            if self._remove(request_id) is None:
                return False
            self.counters["failed"] += 1
            err = (
                exc
                if isinstance(exc, RequestFailedError)
                else RequestFailedError(f"request failed: {type(exc).__name__}: {exc}")
            )
            self.failures.append((request_id, err))
            return True

    def fail_all(self, exc: BaseException) -> None:
        """Fail every request in flight (a step failed in a way no single request explains)."""
        with self.lock:
            for request_id in list(self.requests):
                self.fail(request_id, exc)

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
            steps = self._native_steps(batch)
            self.step_shape, self.step_count = (prefill_cost, len(batch.decodes)), max(steps, 1)
            self.step_started = t0 = time.perf_counter()
            try:  # the block tables are read here, under the lock: an abort during the forward frees them
                inputs = self.runner.prepare(batch, ahead=max(steps - 1, 0))
            except Exception as exc:
                return self._step_failed(batch, exc)
        try:
            burst, draw, states = None, None, []
            if steps:
                draw, states = self._burst_draw(batch, steps)
                burst = self.runner.run_burst(batch, inputs, steps, self.burst_yield, draw)
                if burst is None:
                    self.sampler.rewind(states, {})  # the ordinary step draws its own
            if burst is None:
                logits = self.runner.run(batch, inputs=inputs)
                tokens, logprobs = self.sampler(logits, batch.samples, self.arch.eos_token_ids)
        except Exception as exc:  # a model error fails this batch's requests; the engine keeps serving
            with self.lock:
                return self._step_failed(batch, exc)
        step_s = time.perf_counter() - t0
        with self.lock:
            self.step_started = None
            if burst is not None:
                return self._burst_done(batch, burst, step_s, states)
            record_prompt_logprobs(batch, self.runner.prompt_logprobs)
            self.scheduler.postprocess(batch)
            self.cost.observe(prefill_cost, len(batch.decodes), step_s)
            if batch.prefills or self.scheduler.waiting:  # decode-only steps schedule without the model
                self.scheduler.set_cost(self.cost.current())
            return self._process(batch, tokens, logprobs)

    def _native_steps(self, batch: ScheduledBatch) -> int:
        """Under the lock, after scheduling: 0 for an ordinary step (logits, then the sampler), else the decode
        steps one native call runs (run_burst): a burst, or one greedy step whose LM head the screen reads (the
        same tokens, most of the head unread). For a burst, the blocks of its later positions are reserved here."""
        seqs = batch.decodes
        plain = (
            self.runner.bursts
            and len(seqs) > 0
            and not batch.prefills
            and not batch.forks
            and not batch.blocks_to_copy
            and len(batch.samples) == len(seqs)
            and all((plain_greedy(s) or plain_sampled(s)) and s.params.logprobs is None for s in seqs)
        )
        if not plain:
            return 0
        if burst_allowed(self.config.decode_burst, len(seqs), len(self.scheduler.waiting)):
            limit = self.runner.max_model_len
            room = [
                min(
                    limit - len(s),
                    limit if s.params.max_tokens is None else s.params.max_tokens - s.num_output_tokens,
                )
                for s in seqs
            ]
            steps = burst_steps(self.config.decode_burst, room)
            if steps > 1 and self.block_manager.reserve_ahead(seqs, steps - 1):
                self.burst_yield.value = 0  # nobody waits now; an arrival from here on ends the burst
                return steps
        greedy = all(plain_greedy(s) for s in seqs)
        return 1 if greedy and self.runner.screens_head(len(seqs)) else 0

    def _burst_draw(self, batch: ScheduledBatch, steps: int) -> tuple[BurstDraw | None, list]:
        """A burst's draw where any of its sequences samples (None: all greedy), and the seeded generators' states
        before it (Sampler.rewind)."""
        seqs = [
            s for s, _ in sorted(batch.samples, key=lambda sample: sample[1])
        ]  # the call's rows, in order
        if all(s.params.greedy for s in seqs):
            return None, []
        u, states = self.sampler.burst_uniforms(seqs, steps)
        inv_temp = [0.0 if s.params.greedy else 1.0 / s.params.temperature for s in seqs]
        min_p = [s.params.min_p for s in seqs]
        if not any(s.params.top_k > 0 or s.params.top_p < 1.0 for s in seqs):
            return BurstDraw(inv_temp, min_p, u), states
        top_k, top_p = [s.params.top_k for s in seqs], [s.params.top_p for s in seqs]
        return BurstDraw(inv_temp, min_p, u, top_k, top_p), states

    def _burst_done(
        self, batch: ScheduledBatch, tokens: list[list[int]], step_s: float, states: list
    ) -> list[RequestOutput]:
        """Under the lock: a burst's tokens (as many steps as it ran), one step at a time as ordinary steps would
        have taken them (a sequence that stops drops the rest), then one output per request with all its new
        tokens; seeded generators end where those ordinary steps would have left them."""
        steps = len(tokens[0])
        touched: dict[str, Request] = {}
        before = {s.seq_id: s.num_output_tokens for s, _ in batch.samples}
        for j in range(steps):
            self.scheduler.postprocess(batch)
            self.cost.observe(0.0, len(batch.decodes), step_s / steps)
            step_tokens = [tokens[row][j] for _, row in batch.samples]
            touched.update(self._accept(batch, step_tokens, [None] * len(step_tokens)))
        self.sampler.rewind(
            states, {s.seq_id: s.num_output_tokens - before[s.seq_id] for s, _ in batch.samples}
        )
        if self.scheduler.waiting:
            self.scheduler.set_cost(self.cost.current())
        return self._outputs(touched)

    def _step_failed(self, batch: ScheduledBatch, exc: Exception) -> list[RequestOutput]:
        """Under the lock: fail this batch's requests; the engine keeps serving."""
        log.exception("step failed; failing %d request(s)", len({s.request_id for s, _ in batch.samples}))
        self.step_started = None
        for request_id in batch.request_ids:
            self.fail(request_id, exc)
        return []

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
        return self._outputs(self._accept(batch, tokens, logprobs))

    def _accept(
        self, batch: ScheduledBatch, tokens: list[int], logprobs: list[TokenLogprob | None]
    ) -> dict[str, Request]:
        """Each sample's token appended (finishing its sequence where it stops); the requests that took one."""
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
                self.fail(req.request_id, exc)
                continue
            touched[req.request_id] = req
            self.counters["generation"] += 1
        return touched

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        now = time.time()
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
                outputs.append(req.output(finished))
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

    # observability
    def stats(self) -> EngineStats:
        with self.lock:  # a consistent snapshot: /metrics scrapes from another thread than the step loop
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
        """The /load JSON (docs/CONTRACTS.md section 4, engine/load_report.py). Not ready while the grammar
        backend's start-up thread runs: on 2 cores a first request beside it took 350-530 ms to its first token
        against ~30 (the thread holds the GIL and a core for ~0.3 s), so traffic waits for it, as /health does."""
        with self.lock:
            return load_report(self, ready and self.guided.settled)

    def queue_view(self) -> QueueView:
        """The scheduler's state as the TTFT model reads it."""
        with self.lock:
            cost, in_progress = self.cost.current(), 0.0
            if self.step_started is not None:
                step, elapsed = cost.step_s(*self.step_shape), time.perf_counter() - self.step_started
                if self.step_count > 1 and step > 0:  # an arrival ends a burst after its step under way
                    elapsed %= step
                in_progress = max(0.0, step - elapsed)
            return queue_view(self.scheduler, cost, self.runner.max_model_len, in_progress)
