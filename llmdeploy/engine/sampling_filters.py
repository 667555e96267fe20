"""top_k and top_p over float32 logit rows, from each row's best candidates instead of a sort of the whole row.

top_k_top_p_by_sort is the definition (and the path for rows whose nucleus is most of the vocabulary); top_k_top_p
keeps what it keeps, found with torch.topk: candidates first, then as many as a one-pass histogram of the row's
probabilities says its nucleus needs.
"""

from __future__ import annotations

import math

import torch

from llmdeploy.kernels import cpu_native

# top_k / top_p filter a row's best candidates (torch.topk) instead of sorting it whole: on 2 Zen 4 cores a sort of
# [32, 49152] logits took 56 ms, a topk of 64 1.5 ms, of 8k 15 ms, of 24k 32 ms, and top_p 0.9 / top_k 50 made a
# batch-32 decode step 2.4x greedy's time (77 against 32 ms, SmolLM2 bf16). A top_p row looks at FIRST_CANDIDATES
# first (a peaked distribution's nucleus is there); a wider one at as many as a histogram of its probabilities in
# powers of two says (nucleus_bound, one pass); one that needs more than vocab / SORT_SHARE is sorted whole.
FIRST_CANDIDATES = 64
MASS_BUCKETS = 64
SORT_SHARE = 2


def top_k_top_p_by_sort(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The definition: each row sorted, ranks from top_k on dropped, then (over the probabilities of what is left)
    every token whose better tokens already hold more than top_p of the mass; dropped logits become -inf."""
    dev, vocab = logits.device, logits.shape[1]
    sorted_logits, order = logits.sort(-1, descending=True)
    ranks = torch.arange(vocab, device=dev)[None, :]
    # any integer is a valid top_k (2**70 too: OpenAI-style APIs do not bound it); beyond the vocabulary it is off
    k = torch.tensor([min(t, vocab) if t > 0 else vocab for t in top_k], device=dev)[:, None]
    drop = ranks >= k
    # float64: a float32 softmax over 49k tokens summed to 1 + 8e-6 and moved a nucleus's edge by a token
    probs = sorted_logits.masked_fill(drop, float("-inf")).double().softmax(-1)
    before = probs.cumsum(-1) - probs  # mass of the better tokens; the best one is always kept
    drop |= before > torch.tensor(top_p, device=dev)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def nucleus_bound(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, a number of best tokens that holds its top_p nucleus: every token whose probability is above the
    first power-of-two step (down from the best) at which the mass above it passes top_p. Those tokens are a prefix
    of the row in descending order whose mass exceeds top_p, so the nucleus ends inside it."""
    gap = logits - logits.amax(-1, keepdim=True)  # <= 0; -inf for masked tokens
    step = gap.mul(-1 / math.log(2)).nan_to_num_(nan=MASS_BUCKETS).clamp_(0, MASS_BUCKETS - 1).long()
    mass = torch.zeros(logits.shape[0], MASS_BUCKETS, device=logits.device).scatter_add_(1, step, gap.exp_())
    mass = mass.cumsum_(-1)
    first = (mass <= top_p[:, None] * mass[:, -1:]).sum(-1).clamp_(max=MASS_BUCKETS - 1)
    return (step <= first[:, None]).sum(-1)


def from_candidates(
    logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows filtered from their best n tokens, and which rows that decided: a row whose top_k is at most n, or, with
    no top_k (k = vocab), whose n best tokens already hold more than top_p of its mass (every later token is
    dropped then too). Undecided rows' results are not meaningful."""
    vocab = logits.shape[1]
    vals, order = logits.topk(n, dim=-1)
    drop = torch.arange(n, device=logits.device)[None, :] >= k[:, None]
    vals = vals.masked_fill(drop, float("-inf"))
    # the mass top_p is measured against: the top_k tokens' where there is a top_k, else the whole row's; in
    # float64 as the definition's (the row's exponentials summed in float64 from float32 terms: 1e-9 apart)
    within = k <= n
    best = vals[:, :1].double()
    probs = (vals.double() - best).exp()
    total = probs.sum(-1)
    if not bool(within.all()):
        row_mass = (logits - vals[:, :1]).exp().sum(-1, dtype=torch.float64)
        total = torch.where(within, total, row_mass)
    probs /= total[:, None]
    before = probs.cumsum(-1) - probs
    drop |= before > p.double()[:, None]
    decided = within | ((k == vocab) & (before[:, -1] > p.double()))
    kept = torch.full_like(logits, float("-inf")).scatter_(1, order, vals.masked_fill(drop, float("-inf")))
    return kept, decided


def top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """top_k_top_p_by_sort's result, from candidates: first FIRST_CANDIDATES (or the largest top_k up to
    vocab / SORT_SHARE), then for rows still undecided as many as nucleus_bound says; a row that needs more than
    vocab / SORT_SHARE, or that its bound leaves undecided (rounding), is sorted whole. Rows with neither stay (with
    no row to filter, `logits` itself comes back)."""
    dev, vocab = logits.device, logits.shape[1]
    cap = vocab // SORT_SHARE
    ks = [min(t, vocab) if t > 0 else vocab for t in top_k]
    rows = [i for i, (k, p) in enumerate(zip(ks, top_p, strict=True)) if k < vocab or p < 1.0]
    if not rows:
        return logits
    native = cpu_native.top_k_top_p_rows(logits, ks, top_p)
    if native is not None:
        return native
    out = None  # a copy of logits for results that come in parts
    for attempt in ("first", "bound", "sort"):
        if not rows:
            break
        idx = torch.tensor(rows, device=dev)
        sub = logits if len(rows) == logits.shape[0] else logits[idx]
        k = torch.tensor([ks[i] for i in rows], device=dev)
        p = torch.tensor([top_p[i] for i in rows], device=dev)
        if attempt == "first":
            n = max([FIRST_CANDIDATES] + [ks[i] for i in rows if ks[i] <= cap])
        elif attempt == "bound":
            need = torch.where(k < vocab, k, nucleus_bound(sub, p))
            n = int(need[need <= cap].max()) if bool((need <= cap).any()) else 0
        if attempt == "sort" or not 0 < n <= cap:  # a small vocabulary is sorted at once
            result = top_k_top_p_by_sort(sub, [top_k[i] for i in rows], [top_p[i] for i in rows])
            decided = torch.ones(len(rows), dtype=torch.bool, device=dev)
        else:
            result, decided = from_candidates(sub, k, p, n)
        if out is None and len(rows) == logits.shape[0] and bool(decided.all()):
            return result  # every row filtered at once: no copy of the logits
        out = logits.clone() if out is None else out
        done = decided.nonzero()[:, 0]
        out[idx[done]] = result[done]
        rows = [r for r, d in zip(rows, decided.tolist(), strict=True) if not d]
    return out
