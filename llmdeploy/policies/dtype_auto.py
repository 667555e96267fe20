"""What `dtype: auto` asks of bfloat16 on a CPU before serving it (engine/cpu_dtype.py measures; `plan` says it).

bf16 changes greedy output, so it has to pay clearly, at one row (bandwidth-bound decode) and at a batch's rows
alike: SmolLM2's projections measured 1.8-2x at both on Zen 4, while a tiny test model's measured 1.17x once and
under 1x other times (timing noise on microsecond calls)."""

from __future__ import annotations

MIN_SPEEDUP = 1.3
ROWS = (1, 32)  # a decode step of one sequence, and of a batch


def describe() -> str:
    rows = " and ".join(str(r) for r in ROWS)
    return f"at least {MIN_SPEEDUP:g}x faster than float32 at {rows} rows"
