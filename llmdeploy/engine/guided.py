"""Constrained decoding: a grammar (JSON schema, any JSON object, regex, a fixed choice) turned into a token
mask per step, so the sampled text always belongs to the grammar.

llguidance does the grammar work (chosen over xgrammar by measurement, bench/RESULTS.md: in random walks over
33 schemas xgrammar let control characters into length-bounded strings, invalid JSON, where llguidance made
none; its mask fill is slower, 2.9 vs 1.8 ms at batch 32 on the 49k SmolLM2 vocabulary, both far under 10% of
a decode step). A spec is compiled once per engine (cached); each constrained sequence owns an LLMatcher.
Per step the sampler calls `apply_logit_rules` for the whole batch: one parallel bitmask fill (llguidance's
executor) and one vectorised apply over the constrained rows, plus `logit_bias` where a row carries one. The
engine advances a sequence's matcher with each accepted token (`GuidedState.accept`).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from llmdeploy.engine.errors import ParamError

if TYPE_CHECKING:
    from llmdeploy.engine.sequence import Sequence

log = logging.getLogger("llmdeploy.engine.guided")

GuidedKind = Literal["json_schema", "json_object", "regex", "choice"]
# a random or confused model can emit whitespace forever inside JSON: a few characters between tokens is all
# any JSON layout needs (indentation included)
JSON_OPTIONS = {"whitespace_pattern": r"[ \t\n]{0,8}"}
MAX_COMPILED = 256  # compiled grammars kept per engine


@dataclass(frozen=True)
class GuidedSpec:
    """What the output must match. `value`: the JSON schema text, the regex, or a JSON list of choices;
    `param`: the request field an invalid value is blamed on (response_format, guided_json, tools...)."""

    kind: GuidedKind
    value: str = ""
    param: str = "guided_json"
    compact: bool = False  # JSON without any whitespace (tool calls: read by programs, never by people)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, param: str, compact: bool = False) -> GuidedSpec:
        return cls("json_schema", json.dumps(schema), param, compact)  # key order is output order

    @classmethod
    def choice(cls, choices: list[str], param: str = "guided_choice") -> GuidedSpec:
        return cls("choice", json.dumps(list(choices)), param)


def grammar_text(spec: GuidedSpec) -> str:
    """The spec as an llguidance grammar (its JSON form); ValueError for a value that is no grammar."""
    from llguidance import LLMatcher

    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "json_schema":
        options = {"whitespace_flexible": False} if spec.compact else JSON_OPTIONS
        return LLMatcher.grammar_from_json_schema(json.loads(spec.value), defaults=options)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    alternatives = " | ".join(json.dumps(c) for c in json.loads(spec.value))  # lark strings take JSON escapes
    return LLMatcher.grammar_from_lark(f"start: {alternatives}")


class GrammarBackend:
    """One engine's grammar side: the tokenizer as llguidance sees it, built off the request path on a thread
    (about two seconds for a 49k vocabulary), and the checked grammars. `eager`: the build starts now (a server,
    whose readiness waits for it); otherwise at the first request that needs it (the offline API: the build's
    thread took the CPU and the GIL from the first generate() call, 0.79 s against 0.26 s for a 256-token
    prompt of bf16 SmolLM2 on 2 Zen 4 cores, for output that never used a grammar)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], eager: bool = True):
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiled: dict[GuidedSpec, str] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self.tokenizer: Any = None  # llguidance.LLTokenizer
        self.executor: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._build, args=(tokenizer,), name="llmdeploy-grammar-init", daemon=True
        )
        if eager:
            self._thread.start()

    def _start(self) -> None:
        with self._lock:
            if self._thread.ident is None:
                self._thread.start()

    def _build(self, tokenizer: Any) -> None:
        try:
            import llguidance
            import llguidance.hf

            # the first stop token ends a finished grammar; the engine stops on any of them
            eos = self.stop_token_ids[0] if self.stop_token_ids else None
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=eos)
            self.executor = llguidance.LLExecutor()
        except Exception as exc:  # no constrained decoding on this engine; requests needing it get a 400
            log.exception("constrained decoding is unavailable")
            self._error = exc
        finally:
            self._ready.set()

    @property
    def available(self) -> bool:
        self._start()
        self._ready.wait()
        return self._error is None

    @property
    def settled(self) -> bool:
        """Whether no build is under way (done, failed, or not started), without waiting for it."""
        return self._ready.is_set() or self._thread.ident is None

    def check(self, params: Any) -> None:
        """ParamError for what this engine cannot honour: an unusable grammar, a logit_bias id beyond the
        vocabulary. Checks the grammar now (cached), so a sequence starts without waiting for it."""
        bad = next((t for t in params.logit_bias or {} if t >= self.vocab_size), None)
        if bad is not None:
            raise ParamError(
                "logit_bias",
                f"logit_bias names token id {bad}, outside this model's vocabulary [0, {self.vocab_size}).",
            )
        if params.guided is not None:
            self.compile(params.guided)

    def compile(self, spec: GuidedSpec) -> str:
        """The checked grammar (cached); ParamError naming spec.param when the value is not usable."""
        if not self.available:
            raise ParamError(spec.param, "Constrained decoding is not available on this engine.")
        with self._lock:
            hit = self._compiled.get(spec)
        if hit is not None:
            return hit
        from llguidance import LLMatcher

        try:
            grammar = grammar_text(spec)
            error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        except Exception as exc:
            error = str(exc)
        if error:
            raise ParamError(spec.param, f"Invalid {spec.param}: {str(error)[:300]}")
        with self._lock:
            if len(self._compiled) >= MAX_COMPILED:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[spec] = grammar
        return grammar

    def new_state(self, spec: GuidedSpec) -> GuidedState:
        from llguidance import LLMatcher

        grammar = self.compile(spec)  # first: it waits for the tokenizer to be ready
        return GuidedState(self, LLMatcher(self.tokenizer, grammar))


class GuidedState:
    """One sequence's place in its grammar."""

    def __init__(self, backend: GrammarBackend, matcher: Any):
        self.backend, self.matcher = backend, matcher

    def fork(self) -> GuidedState:
        return GuidedState(self.backend, self.matcher.deep_copy())

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()

    def accept(self, token_id: int) -> None:
        if self.matcher.is_stopped():
            return  # the grammar ended (with a stop token); the sequence ends with it
        if not self.matcher.consume_token(token_id):
            raise RuntimeError(
                f"token {token_id} does not continue the requested grammar: {self.matcher.get_error()}"
            )


def needs_logit_rules(seq: Sequence) -> bool:
    return seq.guided is not None or bool(seq.params.logit_bias)


def apply_logit_rules(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place over the batch's rows: logit_bias, then the grammar masks of all constrained rows at once."""
    _apply_bias(logits, seqs)
    # a finished grammar's mask allows only the stop token: its rows stay in, so the output ends there
    rows = [i for i, s in enumerate(seqs) if s.guided is not None]
    if not rows:
        return
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

    backend: GrammarBackend = seqs[rows[0]].guided.backend
    bitmask = allocate_token_bitmask(len(rows), backend.vocab_size)
    fill_next_token_bitmask_par(
        backend.executor, [(seqs[i].guided.matcher, j) for j, i in enumerate(rows)], bitmask
    )
    _apply_bitmask(logits, rows, bitmask, seqs)


def _apply_bitmask(
    logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor, seqs: list[Sequence]
) -> None:
    """-inf where a row's bit is 0 (llguidance's layout: bit k of word w is token 32w+k, 1 = allowed)."""
    vocab = logits.shape[1]
    every = rows == list(range(logits.shape[0]))
    sub = logits if every else logits[rows]
    if sub.device.type == "cpu":
        blocked = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, count=vocab, bitorder="little") == 0
        before = sub.clone() if _may_empty(seqs, rows) else None
        np.putmask(sub.numpy(), blocked, -np.inf)
    else:
        bits = bitmask.to(sub.device, non_blocking=True)
        shifts = torch.arange(32, device=sub.device, dtype=torch.int32)
        allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().view(len(rows), -1)[:, :vocab]
        blocked_t = ~allowed
        before = sub.clone() if _may_empty(seqs, rows) else None
        sub.masked_fill_(blocked_t, float("-inf"))
        blocked = blocked_t
    if before is not None:
        _restore_empty_rows(sub, before, blocked)
    if not every:
        logits[rows] = sub


def _may_empty(seqs: list[Sequence], rows: list[int]) -> bool:
    """min_tokens masks the stop tokens before the grammar mask: where the grammar allows only those, the
    row would be all -inf. Only then is a copy kept to fall back on."""
    return any(seqs[i].params.min_tokens > seqs[i].num_output_tokens for i in rows)


def _restore_empty_rows(sub: torch.Tensor, before: torch.Tensor, blocked: Any) -> None:
    blocked_t = torch.as_tensor(blocked, device=sub.device)
    for j in (~torch.isfinite(sub).any(-1)).nonzero().flatten().tolist():
        # the grammar wins over min_tokens: its allowed tokens at their unmasked values
        row = torch.nan_to_num(before[j], neginf=0.0)
        sub[j] = row.masked_fill(blocked_t[j], float("-inf"))


def _apply_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    rows, cols, vals = [], [], []
    vocab = logits.shape[1]
    for i, s in enumerate(seqs):
        for tid, bias in (s.params.logit_bias or {}).items():
            if 0 <= tid < vocab:
                rows.append(i)
                cols.append(tid)
                vals.append(float(bias))
    if rows:
        dev = logits.device
        logits.index_put_(
            (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
            torch.tensor(vals, device=dev, dtype=logits.dtype),
            accumulate=True,
        )
