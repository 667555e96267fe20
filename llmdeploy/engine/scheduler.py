"""Continuous batching: which tokens of which sequences run in the next step. Pure Python (no torch).

Every step: decodes first (one token per running sequence whose prompt is done), then the rest of the token
budget (max_num_batched_tokens) goes to prefill chunks, so a running decode waits at most one chunk.
Several partial prefills may share a step.

Prefill order is earliest deadline first. Each request gets a first-token deadline at arrival from its own prefill
cost (the live step-cost model) and the SLA (llmdeploy/policies/deadline.py: at most twice its own prefill, capped
by the SLA, scaled for prompts whose own prefill alone exceeds it). A short prompt's deadline is near, so it
overtakes a long prompt that arrived earlier; a long prompt that has waited long enough has the earliest deadline
and goes first whatever arrives, so neither class starves. Preempted sequences go back first.

A short request's TTFT is the rest of the step running when it arrives plus its own step, so both stay short:
- A prompt with more uncomputed tokens than `long_prefill_threshold` at admission is long (as in vLLM's
  long_prefill_token_threshold). All long prompts' chunks of one step together cost at most `long_prefill_budget`
  (`long_prefill_budget_alone` with nothing else in the engine): the step-time bound, 3/4 of what a short prompt's
  prefill adds to a step (llmdeploy/engine/prefill_limits.py). The limits follow the live step-cost model
  (`set_cost`).
- A chunk that does not complete its prompt (a long prompt's, or a short one's that does not fit) joins a step
  that completes prompts ahead of it in the order only within their ride limits: the step must still end within
  1.25x each one's own prefill from its arrival (policies/deadline.py); a chunk whose own prompt is behind its
  deadline rides up to their deadlines instead. Work that is more urgent than those prompts comes before them.
- Costs count attention (`attn_cost_context`): a token at context c costs about (1 + c / attn_cost_context)
  tokens, so late chunks of a long prompt shrink and every step stays about as long as its cost in fresh tokens.
Out of blocks: preemption by recompute; the victim is the most recently admitted sequence, which has the least
work to lose; it goes back to the front of the queue.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmdeploy.engine.block_manager import BlockManager
from llmdeploy.engine.config import EngineConfig
from llmdeploy.engine.errors import CapacityError, ContextLengthError
from llmdeploy.engine.prefill_limits import LongPrefillLimits, limits_for_cost, moved
from llmdeploy.engine.sequence import Sequence, SequenceStatus
from llmdeploy.policies.deadline import relative_deadline_s, ride_limit_s
from llmdeploy.policies.step_cost import StepCost, chunk_cost


def chunk_within_cost(context: int, budget: float, attn_cost_context: float) -> int:
    """Largest n with n * (1 + (context + n / 2) / attn_cost_context) <= budget (at least 1)."""
    r, a = attn_cost_context, 1 + context / attn_cost_context
    return max(1, int(r * (math.sqrt(a * a + 2 * budget / r) - a)))


@dataclass
class ScheduledBatch:
    # (seq, chunk tokens from num_computed)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)  # one token each (the last one)
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, child) made this step
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) first
    preempted: list[Sequence] = field(default_factory=list)
    logit_seqs: list[Sequence] = field(default_factory=list)
    samples: list[tuple[Sequence, int]] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def request_ids(self) -> set[str]:
        return {s.request_id for s, _ in self.prefills} | {s.request_id for s in self.decodes}

    def finalize(self) -> ScheduledBatch:
        """Fix which positions yield logits (chunks that end their sequence's tokens, then decodes) and which
        sequences get a token from which logits row (forked children share the parent's row)."""
        self.logit_seqs = [s for s, n in self.prefills if s.num_computed_tokens + n == len(s)] + self.decodes
        rows = {s.seq_id: i for i, s in enumerate(self.logit_seqs)}
        self.samples = [(s, i) for i, s in enumerate(self.logit_seqs)] + [
            (c, rows[p.seq_id]) for p, c in self.forks
        ]
        return self


@dataclass
class _StepSoFar:
    """The step being built: the budgets left, what its prefill chunks cost so far (fresh-token equivalents), and
    when the first tokens it yields are due (the earliest deadline among the prompts it completes)."""

    now: float
    decodes: int
    budget: int  # tokens
    long_budget: float  # long prompts' chunks, cost
    crowded: bool  # other work is in the engine
    prefill_cost: float = 0.0
    finish_by: float = math.inf  # the earliest deadline among the prompts the step completes
    ride_by: float = math.inf  # the earliest ride limit among them


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        config: EngineConfig,
        *,
        aging_steps: int | None = None,
        watermark: float = 0.01,
        attn_cost_context: float | None = None,
        long_prefill_threshold: int | None = None,
        long_prefill_budget: float | None = None,
        long_prefill_budget_alone: float | None = None,
        cost: StepCost | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """From `config`: max_num_seqs, max_num_batched_tokens, max_model_len (the engine's, capped by the
        model's positions) and the TTFT SLA. The keywords are tuning knobs the engine leaves at their default
        except the measured attention cost and the live step-cost model."""
        self.bm, budget = block_manager, config.max_num_batched_tokens
        # every running sequence must fit in one step's budget, or some decodes would stall
        self.max_num_seqs = min(config.max_num_seqs, budget)
        self.max_num_batched_tokens, self.max_model_len = budget, config.max_model_len
        # aging (None: off) is a backstop only: deadlines already bound how long anything waits
        self.aging_steps, self.attn_cost_context = aging_steps, attn_cost_context
        self.ttft_sla_s, self.clock = config.ttft_sla_s, clock
        nominal = StepCost(0.0, 1e-3, 0.0, attn_cost_context=attn_cost_context)  # 1 ms a token
        self.cost = cost or nominal
        # limits given explicitly stay; else they follow the step-cost model (set_cost)
        self.live_limits = cost is not None and long_prefill_threshold is None
        if self.live_limits:
            self._set_limits(limits_for_cost(budget, self.cost))
        else:
            self.limits = None
            self.long_prefill_threshold = long_prefill_threshold
            self.long_prefill_budget = long_prefill_budget or long_prefill_threshold
            self.long_prefill_budget_alone = long_prefill_budget_alone or math.inf
        self.long_prefills: set[int] = set()  # running sequences whose prompt was long at admission
        self.deadlines: dict[int, float] = {}  # seq_id -> first-token deadline (on self.clock)
        # seq_id -> when a step completing it must end for other prompts' partial chunks to join it
        self.ride_limits: dict[int, float] = {}
        self.watermark_blocks = max(1, int(watermark * block_manager.num_blocks))
        self.waiting: list[Sequence] = []  # preempted ones at the front
        self.running: list[Sequence] = []  # in admission order
        self.step_count = 0
        self.num_preemptions = 0

    def _set_limits(self, limits: LongPrefillLimits) -> None:
        self.limits = limits
        self.long_prefill_threshold = limits.threshold
        self.long_prefill_budget, self.long_prefill_budget_alone = limits.budget, limits.budget_alone

    def set_cost(self, cost: StepCost) -> bool:
        """The live step-cost model (the engine passes it after every step). New deadlines and the room left in a
        step use it at once; derived long-prefill limits change when it moves them by over 10% (True then), so a
        slower or busier machine adjusts by itself without the limits jittering step to step."""
        self.cost = cost
        if not self.live_limits:
            return False
        new = limits_for_cost(self.max_num_batched_tokens, cost)
        if self.limits is not None and not moved(self.limits, new):
            return False
        self._set_limits(new)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Reject at once what could never run (never a hang): too long for the model or for the whole KV cache."""
        total = num_prompt_tokens + (max_tokens or 1)
        if total > self.max_model_len:
            asked = f"{num_prompt_tokens} in the prompt" + (
                f" + {max_tokens} max_tokens" if max_tokens else ""
            )
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens, but {total} were requested "
                f"({asked}). Shorten the prompt or lower max_tokens.",
                num_prompt_tokens,
                self.max_model_len,
            )
        if self.bm.blocks_for(total) > self.bm.num_blocks:
            raise CapacityError(
                f"The request needs {total} tokens of KV cache but the whole cache holds "
                f"{self.bm.num_blocks * self.bm.block_size}; it can never run on this engine."
            )

    def add(self, seq: Sequence, arrival: float | None = None) -> None:
        """Queue seq; its deadline counts from `arrival` (on self.clock; default: now)."""
        seq.arrival_step = self.step_count
        start = self.clock() if arrival is None else arrival
        self.deadlines[seq.seq_id] = start + relative_deadline_s(
            self.cost, seq.num_uncomputed, self.ttft_sla_s
        )
        self.ride_limits[seq.seq_id] = start + ride_limit_s(self.cost, seq.num_uncomputed, self.ttft_sla_s)
        self.waiting.append(seq)

    def deadline(self, seq: Sequence) -> float:
        return self.deadlines.get(seq.seq_id, math.inf)

    def slots(self, seq: Sequence) -> int:
        return 1 + seq.num_forks

    def schedule(self) -> ScheduledBatch:
        self.step_count += 1
        batch = ScheduledBatch()
        self._schedule_decodes(batch)
        # then prefill chunks: admitted partial prefills and waiting sequences, earliest deadline first
        order = self._prefill_order()
        crowded = bool(batch.decodes) or len(order) > 1
        long_budget = math.inf
        if self.long_prefill_threshold:
            long_budget = self.long_prefill_budget if crowded else self.long_prefill_budget_alone
        budget = self.max_num_batched_tokens - len(batch.decodes)
        step = _StepSoFar(self.clock(), len(batch.decodes), budget, long_budget, crowded)
        num_slots, admitting = sum(self.slots(s) for s in self.running), True
        for seq in order:
            if step.budget <= 0:
                break
            long = self.is_long(seq)
            if (long and step.long_budget <= 0) or self._chunk_limit(seq, long, step) <= 0:
                continue  # no long budget left, or a partial chunk with no room before the step's first tokens
            if seq.status is SequenceStatus.WAITING:
                if not admitting:
                    continue
                if num_slots + self.slots(seq) > self.max_num_seqs or not self.bm.can_allocate(
                    seq, reserve=self.watermark_blocks if self.running else 0
                ):
                    admitting = False  # strict order: a big request at the head is not overtaken forever
                    continue
                self._admit(seq)  # a prefix-cache hit may leave fewer tokens (and make a long prompt short)
                num_slots += self.slots(seq)
                long = self.is_long(seq)
            self._add_chunk(batch, step, seq, long)
        served = {s.seq_id for s, _ in batch.prefills}
        for seq in order:  # age only what got no prefill progress this step
            seq.starved_steps = 0 if seq.seq_id in served else seq.starved_steps + 1
        return batch.finalize()

    def _schedule_decodes(self, batch: ScheduledBatch) -> None:
        """One token for every running sequence whose prompt is done; out of blocks -> preempt the most recently
        admitted."""
        for seq in [s for s in self.running if s.num_uncomputed == 1]:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted above in this loop
            while not self.bm.can_append(seq):
                victim = self.running[-1]
                self.preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                copy = self.bm.may_append(seq)
                if copy:
                    batch.blocks_to_copy.append(copy)
                batch.decodes.append(seq)
                if seq.num_forks:  # a prompt whose last token is its only uncached one
                    self._fork(seq, batch)

    def _add_chunk(self, batch: ScheduledBatch, step: _StepSoFar, seq: Sequence, long: bool) -> None:
        chunk = min(seq.num_uncomputed, max(1, self._chunk_limit(seq, long, step)))
        batch.prefills.append((seq, chunk))
        cost = chunk_cost(seq.num_computed_tokens, chunk, self.attn_cost_context)
        step.budget -= chunk
        step.prefill_cost += cost
        if long:
            step.long_budget -= cost
        if chunk == seq.num_uncomputed:
            step.finish_by = min(step.finish_by, self.deadline(seq))
            step.ride_by = min(step.ride_by, self.ride_limits.get(seq.seq_id, self.deadline(seq)))
            if seq.num_forks:
                self._fork(seq, batch)

    def _chunk_limit(self, seq: Sequence, long: bool, step: _StepSoFar) -> int:
        """Most tokens seq's chunk may have now (0: none). A short prompt's chunk that completes it takes what the
        budgets allow; any other (a long prompt's, or a partial one) must also leave the step ending by the
        deadlines of the prompts the step completes (they are ahead of seq in the order)."""
        limit = self._limit(seq, step.budget, step.long_budget if long else math.inf, step.crowded)
        if (seq.num_uncomputed <= limit and not long) or step.finish_by == math.inf:
            return limit
        if self.cost.prefill_token_s <= 0:
            return limit
        # a prompt short of slack (_behind) rides up to the others' deadlines, any other only within their ride
        # limits; judged on the conservative step time (a noisy machine: fewer riders)
        end = step.finish_by if self._behind(seq, step) else step.ride_by
        spare_s = (end - step.now) / self.cost.conservative(1.0)
        # with seq's chunk the step carries prefill, its first chunk or not
        step_s = self.cost.with_prefill_s(step.decodes) + self.cost.prefill_token_s * step.prefill_cost
        room = (spare_s - step_s) / self.cost.prefill_token_s
        if room < chunk_cost(seq.num_computed_tokens, 1, self.attn_cost_context):
            return 0
        return min(limit, self._chunk_for(seq, room))

    def _behind(self, seq: Sequence, step: _StepSoFar) -> bool:
        """Whether seq's deadline leaves less than its remaining prefill again (at one chunk of the long budget a
        step): other work takes steps too, so a prompt with less slack than that must not wait for riding room."""
        per_step = self.long_prefill_budget if self.is_long(seq) else self.max_num_batched_tokens
        left = self.cost.prefill_s(
            seq.num_uncomputed, int(per_step or 1), step.decodes, seq.num_computed_tokens
        )
        return step.now + 2 * left > self.deadline(seq)

    def _limit(self, seq: Sequence, budget: int, long_budget: float, crowded: bool) -> int:
        """Most tokens seq's chunk may have this step: the token budget, the long prompts' cost budget, and while
        others wait a continuing chunk's cost (its attention over the cached context) within the token budget."""
        if long_budget < math.inf:
            return min(budget, self._chunk_for(seq, long_budget))
        if crowded and seq.num_computed_tokens:
            return min(budget, self._chunk_for(seq, budget))
        return budget

    def _chunk_for(self, seq: Sequence, cost: float) -> int:
        """The most tokens of seq's next chunk within `cost` (tokens alone without attn_cost_context)."""
        if not self.attn_cost_context:
            return max(1, int(cost))
        return chunk_within_cost(seq.num_computed_tokens, cost, self.attn_cost_context)

    def is_long(self, seq: Sequence) -> bool:
        """Long prompt (see the module doc); decided at admission, when prefix-cache hits are known."""
        if seq.status is SequenceStatus.RUNNING:
            return seq.seq_id in self.long_prefills
        return self.long_prefill_threshold is not None and seq.num_uncomputed > self.long_prefill_threshold

    def _prefill_order(self) -> list[Sequence]:
        cands = [s for s in self.running if s.num_uncomputed > 1] + self.waiting
        return sorted(cands, key=self._priority)

    def _priority(self, seq: Sequence) -> tuple:
        if seq.num_preemptions and seq.status is SequenceStatus.WAITING:
            return (0, seq.arrival_step, 0.0, seq.seq_id)  # preempted: front of the queue
        if self.aging_steps is not None and seq.starved_steps >= self.aging_steps:
            return (1, seq.arrival_step, 0.0, seq.seq_id)
        return (2, 0, self.deadline(seq), seq.seq_id)

    def _admit(self, seq: Sequence) -> None:
        self.bm.allocate(seq)
        if self.is_long(seq):  # still WAITING: judged on what the prefix cache left to compute
            self.long_prefills.add(seq.seq_id)
        seq.admitted_once = True
        seq.status = SequenceStatus.RUNNING
        self.waiting.remove(seq)
        self.running.append(seq)

    def _fork(self, parent: Sequence, batch: ScheduledBatch) -> None:
        for i in range(1, parent.num_forks + 1):
            child = parent.fork(parent.index + i)
            self.bm.fork(parent, child)
            child.num_computed_tokens = len(parent)  # the parent's chunk computes the shared prompt this step
            self.deadlines[child.seq_id] = self.deadline(parent)
            self.ride_limits[child.seq_id] = self.ride_limits.get(parent.seq_id, self.deadline(parent))
            self.running.append(child)
            batch.forks.append((parent, child))
        parent.num_forks = 0

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.long_prefills.discard(seq.seq_id)
        self.bm.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, seq)

    def postprocess(self, batch: ScheduledBatch) -> None:
        """After the forward: the chunks' K/V are in the cache (register full blocks for prefix reuse)."""
        for seq, n in batch.prefills:
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens += n
                self.bm.cache_computed_blocks(seq)
                if seq.num_uncomputed <= 1:
                    self.long_prefills.discard(seq.seq_id)
        for seq in batch.decodes:
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens += 1
                self.bm.cache_computed_blocks(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Leave at once (finished, aborted or failed): blocks back to the pool."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.bm.deallocate(seq)
            self.long_prefills.discard(seq.seq_id)
        else:
            self.waiting.remove(seq)
        self.deadlines.pop(seq.seq_id, None)
        self.ride_limits.pop(seq.seq_id, None)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def pending_prefill_tokens(self) -> int:
        return sum(s.num_uncomputed for s in self.waiting) + sum(
            s.num_uncomputed for s in self.running if s.num_uncomputed > 1
        )
