"""Decode steps of sampled requests against greedy ones: what sampling adds to a step, with this engine's sampler
(native draw, top_k/top_p from candidates, sampled decode bursts) and with the torch-ops baseline it replaced
(softmax/cumsum/searchsorted draw, a sort of every row for top_k/top_p, no bursts for sampled rows), alternating
in one process.

    python bench/sampling_steps.py [--batches 1,8,32] [--steps 16] [--rounds 2] [--dtype bfloat16]

Each cell: ms a step (wall time of --steps decode steps after the batch's prefills, over the tokens they made,
times the batch: a burst's step counts as the steps it ran), the best of --rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import ceilings  # noqa: E402
from bench.small_batches import start_decoding  # noqa: E402
from llmdeploy.engine import (  # noqa: E402
    LLM,
    SamplingParams,
    llm_engine,
    sampling_filters,
)
from llmdeploy.engine import sampler as sampler_mod  # noqa: E402
from llmdeploy.kernels import cpu_native  # noqa: E402

MODEL = "builtin:smollm2-135m-instruct"
CASES = {
    "greedy": dict(temperature=0),
    "T 0.7": dict(temperature=0.7),
    "T 0.7 top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "T 1 top_k 50": dict(temperature=1.0, top_k=50),
    "T 1 min_p 0.05": dict(temperature=1.0, min_p=0.05),
}


@contextlib.contextmanager
def baseline():
    """The sampler as it was: torch ops for the draw, a whole-row sort for top_k/top_p, greedy-only bursts."""
    saved = (
        sampler_mod.top_k_top_p,
        cpu_native.sample_rows,
        cpu_native.top_k_top_p_rows,
        llm_engine.plain_sampled,
    )
    sampler_mod.top_k_top_p = sampling_filters.top_k_top_p_by_sort
    cpu_native.sample_rows = lambda *a: None
    cpu_native.top_k_top_p_rows = lambda *a: None  # else the sampler filters natively before its torch ops
    llm_engine.plain_sampled = lambda seq: False
    try:
        yield
    finally:
        (
            sampler_mod.top_k_top_p,
            cpu_native.sample_rows,
            cpu_native.top_k_top_p_rows,
            llm_engine.plain_sampled,
        ) = saved


def step_ms(
    llm: LLM, batch: int, params: SamplingParams, steps: int, salt: int, prompt_len: int = 128
) -> float:
    e = llm.engine
    start_decoding(llm, batch, params, prompt_len, salt)
    t, made = time.perf_counter(), e.counters["generation"]
    for _ in range(steps):
        e.step()
    elapsed, made = time.perf_counter() - t, e.counters["generation"] - made
    for rid in list(e.requests):
        e.abort(rid)
    while e.has_unfinished():
        e.step()
    return 1e3 * elapsed * batch / made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    print(ceilings.cpu_info().line())
    llm = LLM(model=MODEL, dtype=args.dtype, max_num_seqs=64)
    print(f"{args.dtype}; ms a step, best of {args.rounds}: this sampler / the torch-ops baseline (ratio)")
    print(f"{'batch':>5}  " + "  ".join(f"{name:>22}" for name in CASES))
    salt = 0
    for batch in [int(b) for b in args.batches.split(",")]:
        cells = []
        for kw in CASES.values():
            params = SamplingParams(max_tokens=4 * args.steps + 16, ignore_eos=True, seed=1, **kw)
            new, old = [], []
            for _ in range(args.rounds):
                salt += 1
                new.append(step_ms(llm, batch, params, args.steps, salt))
                with baseline():
                    salt += 1
                    old.append(step_ms(llm, batch, params, args.steps, salt))
            cells.append(f"{min(new):6.2f} / {min(old):6.2f} ({min(new) / min(old):.2f})")
        print(f"{batch:5d}  " + "  ".join(f"{c:>22}" for c in cells), flush=True)
    print(ceilings.cpu_info().line())


if __name__ == "__main__":
    main()
