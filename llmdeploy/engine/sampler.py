"""Batched sampling over float32 logits.

Order per row: penalties (repetition over prompt + output as HF; presence/frequency over output as OpenAI),
min_tokens (EOS and stop_token_ids masked), then greedy argmax (temperature 0: no randomness, so the choice depends
only on the row's own logits) or temperature -> top_k -> top_p (engine/sampling_filters.py) -> min_p -> one draw by
inverse CDF. Seeded requests draw from their own torch.Generator (same seed, same output, whatever else is in the
batch); unseeded ones from the engine's.
Logprobs are the raw model distribution (log_softmax of the logits before any processing), as vLLM's default.
"""

from __future__ import annotations

import torch

from llmdeploy.engine.guided import apply_logit_rules, needs_logit_rules
from llmdeploy.engine.outputs import TokenLogprob
from llmdeploy.engine.sampling_filters import top_k_top_p
from llmdeploy.engine.sequence import Sequence
from llmdeploy.kernels import cpu_native


def min_tokens_active(seq: Sequence) -> bool:
    """Whether the sequence is still short of min_tokens (its stop tokens are masked)."""
    return seq.num_output_tokens < seq.params.min_tokens


def logits_as_they_come(seq: Sequence) -> bool:
    """Whether this sequence's logits go to the pick unchanged: no penalties, min_tokens reached, no grammar or
    logit_bias."""
    return not seq.params.has_penalties and not min_tokens_active(seq) and not needs_logit_rules(seq)


def plain_greedy(seq: Sequence) -> bool:
    """Whether this sequence's next token is its logits' argmax as they come (logprobs aside: they read the logits,
    they do not change the pick)."""
    return seq.params.greedy and logits_as_they_come(seq)


def plain_sampled(seq: Sequence) -> bool:
    """Whether this sequence's next token is drawn from its logits as they come at its temperature, with top_k,
    top_p and min_p at most: the native filter and draw take such a row whole, so a decode burst may sample it."""
    return not seq.params.greedy and logits_as_they_come(seq)


def penalty_index(rows: list[tuple[int, list[int]]], vocab: int, device: torch.device) -> torch.Tensor:
    """Flat positions (row * vocab + token) of each (row, token ids) pair's tokens inside the vocabulary."""
    ids = torch.tensor([t for _, tokens in rows for t in tokens], dtype=torch.long, device=device)
    row = torch.tensor([r for r, tokens in rows for _ in tokens], dtype=torch.long, device=device)
    keep = (ids >= 0) & (ids < vocab)
    return (row * vocab + ids)[keep]


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, samples: list[tuple[Sequence, int]], eos_token_ids: list[int]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [R, V] float32 (rows of batch.logit_seqs); samples: (seq, row) -> one token per sample."""
        seqs = [s for s, _ in samples]
        rows = [r for _, r in samples]
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, device=logits.device)]
        plain = all(plain_greedy(s) for s in seqs)
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        if plain and not want_logprobs:  # fast path: no copies, no sort
            tokens = cpu_native.argmax_rows(logits)
            return tokens if tokens is not None else logits.argmax(-1).tolist(), [None] * len(seqs)
        raw = logits
        if not all(logits_as_they_come(s) for s in seqs):
            logits = logits.clone(memory_format=torch.contiguous_format)
            self._apply_penalties(logits, seqs)
            self._mask_stops(logits, seqs, eos_token_ids)
            if any(needs_logit_rules(s) for s in seqs):
                apply_logit_rules(logits, seqs)  # logit_bias and grammar masks (engine/guided.py)
        token_list = [0] * len(seqs)
        for greedy in (True, False):
            picked = [i for i, s in enumerate(seqs) if s.params.greedy == greedy]
            if not picked:
                continue
            sub = logits if len(picked) == len(seqs) else logits[torch.tensor(picked, device=logits.device)]
            if greedy:
                chosen = cpu_native.argmax_rows(sub) or sub.argmax(-1).tolist()
            else:
                chosen = self._sample(sub, [seqs[i] for i in picked])
            for i, t in zip(picked, chosen, strict=True):
                token_list[i] = t
        return token_list, self._logprobs(raw, seqs, token_list) if want_logprobs else [None] * len(seqs)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """In place, all rows at once (a row's own loop of small tensor ops was ~0.15 ms a row: 5 ms of a batch-32
        step): repetition over each row's distinct prompt + output tokens, then presence/frequency over its output
        tokens' counts. `logits` is contiguous (the caller's copy)."""
        vocab, dev = logits.shape[1], logits.device
        flat = logits.view(-1)
        rep = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
        if rep:
            # a token seen twice is read twice and written twice with the same value: no unique() needed
            seen = penalty_index([(i, seqs[i].token_ids) for i in rep], vocab, dev)
            factor = torch.ones(len(seqs), dtype=logits.dtype, device=dev)
            factor[rep] = torch.tensor([seqs[i].params.repetition_penalty for i in rep], dtype=logits.dtype)
            v, f = flat[seen], factor[seen // vocab]
            # a tiny penalty (5e-324 is legal) must not make +inf (then NaN)
            hi = torch.finfo(logits.dtype).max
            flat[seen] = torch.where(v > 0, v / f, v * f).clamp(-hi, hi)
        counted = [
            i
            for i, s in enumerate(seqs)
            if (s.params.presence_penalty or s.params.frequency_penalty) and s.num_output_tokens
        ]
        if counted:
            out = penalty_index([(i, seqs[i].output_token_ids) for i in counted], vocab, dev)
            where, counts = out.unique(return_counts=True)
            row = where // vocab
            presence = torch.tensor([s.params.presence_penalty for s in seqs], dtype=logits.dtype, device=dev)
            frequency = torch.tensor(
                [s.params.frequency_penalty for s in seqs], dtype=logits.dtype, device=dev
            )
            flat[where] -= frequency[row] * counts.to(logits.dtype) + presence[row]

    def _mask_stops(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int]) -> None:
        vocab = logits.shape[1]
        for i, seq in enumerate(seqs):
            if min_tokens_active(seq):
                ids = [t for t in [*eos_token_ids, *seq.params.stop_token_ids] if 0 <= t < vocab]
                if ids:
                    logits[i, ids] = float("-inf")

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        dev = logits.device
        u = self._uniforms(seqs)
        top_k = [s.params.top_k if s.params.top_k > 0 else 0 for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        min_p = [s.params.min_p for s in seqs]
        filtered = any(top_k) or any(p < 1.0 for p in top_p)
        # the temperature, top_k / top_p, min_p and the draw in native passes over each row, as a sampled decode
        # burst runs them (the same tokens)
        inv_temp = [1.0 / s.params.temperature for s in seqs]
        kept = cpu_native.top_k_top_p_rows(logits, top_k, top_p, inv_temp) if filtered else logits
        tokens = cpu_native.sample_rows(kept, inv_temp, min_p, u) if kept is not None else None
        if tokens is not None:
            return tokens
        # penalties can make logits +inf, and a low temperature over large logits overflows: either would turn
        # softmax into NaN. So: +inf -> the largest float, then the row's best logit moved to 0 before dividing
        # (softmax is unchanged by the shift), which keeps the favoured token ahead of a runner-up that overflows
        finfo = torch.finfo(logits.dtype)
        logits = logits.nan_to_num(nan=float("-inf"), posinf=finfo.max)
        logits = logits - logits.amax(-1, keepdim=True).clamp_min(finfo.min)
        logits = logits / torch.tensor([s.params.temperature for s in seqs], device=dev)[:, None]
        if filtered:
            logits = top_k_top_p(logits, top_k, top_p)
            tokens = cpu_native.sample_rows(logits, [1.0] * len(seqs), min_p, u)
            if tokens is not None:
                return tokens
        probs = logits.softmax(-1)
        if any(min_p):
            floor = torch.tensor(min_p, device=dev)[:, None] * probs.max(-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        return self._draw(probs, u)

    def burst_uniforms(
        self, seqs: list[Sequence], steps: int
    ) -> tuple[list[float], list[tuple[Sequence, torch.Tensor]]]:
        """The uniform numbers of `steps` steps of these rows, step-major (u[j * rows + n]): a seeded row's from its
        own generator, as that many ordinary steps draw them; and those generators' states before, for rewind."""
        states = [(s, s.generator.get_state()) for s in seqs if s.generator is not None]
        dev = self.device
        own = {s.seq_id: torch.rand(steps, generator=s.generator, device=dev).tolist() for s, _ in states}
        unseeded = iter(
            torch.rand(steps * (len(seqs) - len(own)), generator=self.generator, device=dev).tolist()
        )
        return [
            own[s.seq_id][j] if s.seq_id in own else next(unseeded) for j in range(steps) for s in seqs
        ], states

    @staticmethod
    def rewind(states: list[tuple[Sequence, torch.Tensor]], used: dict[int, int]) -> None:
        """Seeded generators back to where `used[seq_id]` ordinary steps would have left them (a burst drew for
        every step it might run; a stop or a yield uses fewer)."""
        for seq, state in states:
            seq.generator.set_state(state)
            if used.get(seq.seq_id):
                torch.rand(used[seq.seq_id], generator=seq.generator, device=seq.generator.device)

    def _uniforms(self, seqs: list[Sequence]) -> list[float]:
        """One uniform number in [0, 1) per row, from the request's own generator where it has a seed."""
        if all(s.generator is None for s in seqs):
            return torch.rand(len(seqs), generator=self.generator, device=self.device).tolist()
        return [
            torch.rand(1, generator=s.generator or self.generator, device=self.device).item() for s in seqs
        ]

    @staticmethod
    def _draw(probs: torch.Tensor, u: list[float]) -> list[int]:
        """One token per row from its probabilities by inverse CDF with the row's uniform number (an exponential
        race over the vocabulary drew 49k random numbers a row: ~1 ms a token on CPU); the native sample_rows is
        the same draw in one pass."""
        cdf = probs.cumsum(-1)
        total = cdf[:, -1:]
        target = torch.tensor(u, dtype=probs.dtype, device=probs.device)[:, None] * total
        picked = torch.searchsorted(cdf, target.contiguous(), right=True)
        # u * total can round up to total: the last token with mass, never one past it (or a masked one)
        last = torch.searchsorted(cdf, total.contiguous(), right=False)
        return torch.minimum(picked, last)[:, 0].tolist()

    @staticmethod
    def _logprobs(raw: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprob | None]:
        idx = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        lp = torch.log_softmax(raw[torch.tensor(idx, device=raw.device)], dim=-1)
        chosen = lp.gather(1, torch.tensor([tokens[i] for i in idx], device=raw.device)[:, None])[
            :, 0
        ].tolist()
        k = max(seqs[i].params.logprobs for i in idx)
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        out: list[TokenLogprob | None] = [None] * len(seqs)
        for j, i in enumerate(idx):
            n = seqs[i].params.logprobs
            out[i] = TokenLogprob(tokens[i], chosen[j], list(zip(top_i[j][:n], top_v[j][:n], strict=True)))
        return out
