"""Continuous batching: which tokens of which sequences run in the next step. Pure Python (no torch).

Every step: decodes first (one token per running sequence whose prompt is done), then the rest of the token
budget (max_num_batched_tokens) goes to prefill chunks, so a running decode waits at most one chunk.
Several partial prefills may share a step. Prefill order is shortest-remaining-prefill-first (short prompts
get their first token quickly even behind a 10k-token prompt) with an age bound: a sequence that has gone
`aging_steps` steps in a row without prefill progress goes first, oldest first, so a long prompt gets a chunk at
least that often however many short ones arrive, yet does not crowd them out while it progresses.

A short request's TTFT is the rest of the step running when it arrives plus its own step, so both stay short:
- With `long_prefill_threshold` set, a prompt with more uncomputed tokens than that at admission is long (as in
  vLLM's long_prefill_token_threshold). While other work is in the engine, all long prompts' chunks of one step
  together cost at most `long_prefill_budget` (default: the threshold), so no step is longer than a short prompt's
  own; long prompts come after short ones in the prefill order.
- A step that completes some prompt carries no partial chunk and no long prompt's chunk (unless aged): the steps
  that produce first tokens stay short.
- Costs count attention (`attn_cost_context`): a token at context c costs about (1 + c / attn_cost_context)
  tokens, so late chunks of a long prompt shrink and every step stays about as long as its cost in fresh tokens.
Out of blocks: preemption by recompute; the victim is the most recently admitted sequence, which has the least
work to lose; it goes back to the front of the queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmdeploy.engine.block_manager import BlockManager
from llmdeploy.engine.errors import CapacityError, ContextLengthError
from llmdeploy.engine.sequence import Sequence, SequenceStatus


def chunk_within_cost(context: int, budget: float, attn_cost_context: float) -> int:
    """Largest n with n * (1 + (context + n / 2) / attn_cost_context) <= budget (at least 1)."""
    r, a = attn_cost_context, 1 + context / attn_cost_context
    return max(1, int(r * (math.sqrt(a * a + 2 * budget / r) - a)))


# A long prompt's chunks may add about this much compute to a step: a short request that arrives meanwhile waits
# for the rest of that step before its own runs. That is about one short prompt's prefill on the 2-core CPU (128
# tokens: 0.09 s); on a GPU the budget fractions bind long before it.
LONG_PREFILL_STEP_S = 0.1


@dataclass(frozen=True)
class LongPrefillLimits:
    threshold: int  # more uncomputed prompt tokens than this at admission: a long prompt
    budget: int  # long prompts' chunks of one step together, while other work is in the engine
    budget_alone: int  # the same with nothing else in the engine (a short one may arrive mid-step)


def long_prefill_limits(max_num_batched_tokens: int, prefill_s_per_token: float) -> LongPrefillLimits:
    """Long is over half the step budget, and long chunks get 3/8 of it while others run (bench/mixed_ttft.py,
    budget 256: 1/2 gave short p99 TTFT 2.1-3.5x their TTFT alone, 3/8 1.9-2.5x, 1/4 1.8-2.3x but long prompts'
    TTFT up to 5.4 s instead of 3.5 s) -- each capped by time at the measured prefill rate, so that a large
    budget on a slow device (2048 tokens: 1.6 s a step on the CPU) cannot make a short request wait for seconds."""
    b = max_num_batched_tokens
    in_step = max(1, int(LONG_PREFILL_STEP_S / max(prefill_s_per_token, 1e-9)))
    return LongPrefillLimits(
        threshold=max(1, min(b // 2, 2 * in_step)),
        budget=max(1, min(3 * b // 8, in_step)),
        budget_alone=min(b, in_step),
    )


def chunk_cost(context: int, n: int, attn_cost_context: float | None) -> float:
    """A chunk of n tokens after `context` cached ones, in fresh-token equivalents."""
    return n * (1 + (context + n / 2) / attn_cost_context) if attn_cost_context else float(n)


@dataclass
class ScheduledBatch:
    prefills: list[tuple[Sequence, int]] = field(
        default_factory=list
    )  # (seq, chunk tokens from num_computed)
    decodes: list[Sequence] = field(default_factory=list)  # one token each (the last one)
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, child) made this step
    blocks_to_copy: list[tuple[int, int]] = field(
        default_factory=list
    )  # copy-on-write (src, dst) before the step
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

    def finalize(self) -> ScheduledBatch:
        """Fix which positions yield logits (chunks that end their sequence's tokens, then decodes) and which
        sequences get a token from which logits row (forked children share the parent's row)."""
        self.logit_seqs = [s for s, n in self.prefills if s.num_computed_tokens + n == len(s)] + self.decodes
        rows = {s.seq_id: i for i, s in enumerate(self.logit_seqs)}
        self.samples = [(s, i) for i, s in enumerate(self.logit_seqs)] + [
            (c, rows[p.seq_id]) for p, c in self.forks
        ]
        return self


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        aging_steps: int = 16,
        watermark: float = 0.01,
        attn_cost_context: float | None = None,
        long_prefill_threshold: int | None = None,
        long_prefill_budget: float | None = None,
        long_prefill_budget_alone: float | None = None,
    ):
        self.bm = block_manager
        # every running sequence must fit in one step's budget, or some decodes would stall
        self.max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
        self.max_num_batched_tokens, self.max_model_len = max_num_batched_tokens, max_model_len
        self.aging_steps, self.attn_cost_context = aging_steps, attn_cost_context
        self.long_prefill_threshold = long_prefill_threshold
        self.long_prefill_budget = long_prefill_budget or long_prefill_threshold
        self.long_prefill_budget_alone = long_prefill_budget_alone or math.inf
        self.long_prefills: set[int] = set()  # running sequences whose prompt was long at admission
        self.watermark_blocks = max(1, int(watermark * block_manager.num_blocks))
        self.waiting: list[Sequence] = []  # preempted ones at the front
        self.running: list[Sequence] = []  # in admission order
        self.step_count = 0
        self.num_preemptions = 0

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

    def add(self, seq: Sequence) -> None:
        seq.arrival_step = self.step_count
        self.waiting.append(seq)

    def slots(self, seq: Sequence) -> int:
        return 1 + seq.num_forks

    def schedule(self) -> ScheduledBatch:
        self.step_count += 1
        batch, budget = ScheduledBatch(), self.max_num_batched_tokens
        # decodes first; out of blocks -> preempt the most recently admitted
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
        budget = self.max_num_batched_tokens - len(batch.decodes)
        # then prefill chunks: admitted partial prefills and waiting sequences, by priority
        num_slots = sum(self.slots(s) for s in self.running)
        admitting, completed_one = True, False
        order = self._prefill_order()
        crowded = bool(batch.decodes) or len(order) > 1
        long_budget = math.inf
        if self.long_prefill_threshold:
            long_budget = self.long_prefill_budget if crowded else self.long_prefill_budget_alone
        for seq in order:
            if budget <= 0:
                break
            young, long = self._priority(seq)[0] >= 2, self._is_long(seq)
            if long and (long_budget <= 0 or (completed_one and young)):
                continue  # the step that yields first tokens stays short
            limit = self._limit(seq, budget, long_budget if long else math.inf, crowded)
            if completed_one and seq.num_uncomputed > limit and young:
                continue  # a young partial chunk would only slow down the step that yields first tokens
            if seq.status is SequenceStatus.WAITING:
                if not admitting:
                    continue
                if num_slots + self.slots(seq) > self.max_num_seqs or not self.bm.can_allocate(
                    seq, reserve=self.watermark_blocks if self.running else 0
                ):
                    admitting = False  # strict order: a big request at the head is not overtaken forever
                    continue
                self._admit(seq)
                num_slots += self.slots(seq)
                if long and not self._is_long(seq):  # a prefix-cache hit made it short after all
                    long, limit = False, self._limit(seq, budget, math.inf, crowded)
            chunk = min(seq.num_uncomputed, limit)
            batch.prefills.append((seq, chunk))
            budget -= chunk
            if long:
                long_budget -= chunk_cost(seq.num_computed_tokens, chunk, self.attn_cost_context)
            completed_one |= chunk == seq.num_uncomputed
            if chunk == seq.num_uncomputed and seq.num_forks:
                self._fork(seq, batch)
        served = {s.seq_id for s, _ in batch.prefills}
        for seq in order:  # age only what got no prefill progress this step
            seq.starved_steps = 0 if seq.seq_id in served else seq.starved_steps + 1
        return batch.finalize()

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

    def _is_long(self, seq: Sequence) -> bool:
        """Long prompt (see the module doc); decided at admission, when prefix-cache hits are known."""
        if seq.status is SequenceStatus.RUNNING:
            return seq.seq_id in self.long_prefills
        return self.long_prefill_threshold is not None and seq.num_uncomputed > self.long_prefill_threshold

    def _prefill_order(self) -> list[Sequence]:
        cands = [s for s in self.running if s.num_uncomputed > 1] + self.waiting
        return sorted(cands, key=self._priority)

    def _priority(self, seq: Sequence) -> tuple:
        if seq.num_preemptions and seq.status is SequenceStatus.WAITING:
            return (0, seq.arrival_step, seq.seq_id)  # preempted: front of the queue
        if seq.starved_steps >= self.aging_steps:
            return (1, seq.arrival_step, seq.seq_id)
        return (2 + self._is_long(seq), seq.num_uncomputed, seq.arrival_step, seq.seq_id)

    def _admit(self, seq: Sequence) -> None:
        self.bm.allocate(seq)
        if self._is_long(seq):  # still WAITING: judged on what the prefix cache left to compute
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
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def pending_prefill_tokens(self) -> int:
        return sum(s.num_uncomputed for s in self.waiting) + sum(
            s.num_uncomputed for s in self.running if s.num_uncomputed > 1
        )
