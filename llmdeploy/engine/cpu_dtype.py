"""What `dtype: auto` means on a CPU: bfloat16 where the CPU has native bf16 matmuls (AVX-512 BF16 or AMX) and
they are measured faster than float32 at the model's own projection shape, float32 everywhere else.

Without those units torch emulates bf16 matmuls (10x slower than float32 on an AVX2 EPYC: bench/ceilings.py), so
only their presence makes bf16 a candidate; the timing then guards against CPUs where it still does not pay. The
choice and its reason go to the engine log and LoadedModel.dtype_reason.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of native bf16 matmul instructions
# bf16 changes greedy output, so it has to pay clearly: SmolLM2's projections measured 2.99x on AVX-512 BF16, while a
# tiny test model's measured 1.17x once and under 1x other times (timing noise on microsecond calls)
MIN_SPEEDUP = 1.5
MIN_TIMED_S = 50e-6  # a float32 projection faster than this is call overhead, not a matmul worth choosing by
ROWS = 32  # a decode batch's worth of rows


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith(("flags", "Features"))), "")
    return set(line.partition(":")[2].split())


def bf16_flag(flags: set[str]) -> str | None:
    """The native bf16 matmul feature this CPU has, or None."""
    return next((f for f in BF16_FLAGS if f in flags), None)


def linear_seconds(x: torch.Tensor, weight: torch.Tensor) -> float:
    """One call of the projection the engine would run (oneDNN-packed where it exists, else torch's default)."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        run = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
    except (RuntimeError, AttributeError):
        run = lambda: torch.nn.functional.linear(x, weight)  # noqa: E731
    run()
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


def projection_seconds(hidden: int, intermediate: int, reps: int = 7) -> tuple[float, float]:
    """Median seconds of a [ROWS, hidden] x [hidden, intermediate] projection in float32 and in bfloat16,
    interleaved (a busy machine slows both alike)."""
    x = torch.randn(ROWS, hidden)
    w = torch.randn(intermediate, hidden)
    xb, wb = x.bfloat16(), w.bfloat16()
    f32, b16 = [], []
    with torch.inference_mode():
        for _ in range(reps):
            f32.append(linear_seconds(x, w))
            b16.append(linear_seconds(xb, wb))
    return statistics.median(f32), statistics.median(b16)


@functools.cache
def choose_cpu_dtype(hidden: int, intermediate: int) -> DtypeChoice:
    flag = bf16_flag(cpu_flags())
    if flag is None:
        return DtypeChoice(torch.float32, "auto: float32 (no AVX-512 BF16 or AMX on this CPU)")
    f32_s, b16_s = projection_seconds(hidden, intermediate)
    if f32_s < MIN_TIMED_S:
        return DtypeChoice(
            torch.float32,
            f"auto: float32 (the CPU has {flag}, but the model's projections are too small for bfloat16 to pay:"
            f" {f32_s * 1e6:.0f} us in float32)",
        )
    speedup = f32_s / max(b16_s, 1e-9)
    if speedup < MIN_SPEEDUP:
        return DtypeChoice(
            torch.float32,
            f"auto: float32 (the CPU has {flag}, but bfloat16 projections measured only {speedup:.2f}x float32)",
        )
    return DtypeChoice(
        torch.bfloat16,
        f"auto: bfloat16 (the CPU has {flag}; bfloat16 projections measured {speedup:.2f}x float32)",
    )
