"""What `dtype: auto` means on a CPU: bfloat16 where the CPU has native bf16 matmuls (AVX-512 BF16 or AMX) and
they are measured faster than float32 at the model's own projection shape, at one row and at a batch's, as the
engine runs them (PackedLinear), float32 everywhere else.

Without those units torch emulates bf16 matmuls (10x slower than float32 on an AVX2 EPYC: bench/ceilings.py), so
only their presence makes bf16 a candidate; the timing then guards against CPUs where it still does not pay. The
choice and its reason go to the engine log and LoadedModel.dtype_reason.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

import torch

from llmdeploy.engine.kept_files import read_kept, write_kept
from llmdeploy.engine.start_measures import kept_path
from llmdeploy.kernels.cpu_flags import cpu_flags
from llmdeploy.policies.dtype_auto import MIN_SPEEDUP, ROWS

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of native bf16 matmul instructions
# a float32 projection faster than this at ROWS[-1] is call overhead, not a matmul to choose by
MIN_TIMED_S = 50e-6
# float32 weights cycled through per timing: more than a core's share of a server L3, so one row streams them from
# memory as decode does (a single cache-resident matrix made one row look compute-bound)
STACK_BYTES = 64 << 20
MAX_STACK = 32


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str


def bf16_flag(flags: set[str]) -> str | None:
    """The native bf16 matmul feature this CPU has, or None."""
    return next((f for f in BF16_FLAGS if f in flags), None)


def pass_seconds(layers: list, x: torch.Tensor) -> float:
    t = time.perf_counter()
    for layer in layers:
        layer.run(x)
    return time.perf_counter() - t


def projection_seconds(hidden: int, intermediate: int, reps: int = 5) -> dict[int, tuple[float, float]]:
    """Rows -> median seconds of one [rows, hidden] x [hidden, intermediate] projection in float32 and in bfloat16,
    each run as the engine runs it (PackedLinear: the native kernels or oneDNN, whichever this CPU gets), over a
    stack of weights too large to stay in cache, interleaved (a busy machine slows both alike)."""
    # imported here: layers asks this module about AMX
    from llmdeploy.engine.models.layers import PackedLinear

    count = max(1, min(MAX_STACK, STACK_BYTES // (4 * hidden * intermediate)))
    f32, b16 = [], []
    for _ in range(count):
        w = torch.randn(intermediate, hidden)
        f32.append(PackedLinear(w, None, register=False))
        b16.append(PackedLinear(w.bfloat16(), None, register=False))
    out = {}
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, hidden)
            xb = x.bfloat16()
            pass_seconds(f32, x), pass_seconds(b16, xb)  # warm-up
            tf, tb = [], []
            for _ in range(reps):
                tf.append(pass_seconds(f32, x) / count)
                tb.append(pass_seconds(b16, xb) / count)
            out[rows] = statistics.median(tf), statistics.median(tb)
    return out


@functools.cache
def choose_cpu_dtype(hidden: int, intermediate: int) -> DtypeChoice:
    """float32, or bfloat16 where the CPU has its units and it is measured faster. The measured choice is kept
    (engine/start_measures.py): a restart on the same machine serves the same dtype, where timing anew near the
    threshold could flip it (and with it greedy output), and does not pay the timing again."""
    flag = bf16_flag(cpu_flags())
    if flag is None:
        return DtypeChoice(torch.float32, "auto: float32 (no AVX-512 BF16 or AMX on this CPU)")
    path = kept_path({"dtype_auto": [hidden, intermediate]})
    kept = read_kept(path) or {}
    if kept.get("dtype") in ("float32", "bfloat16") and isinstance(kept.get("reason"), str):
        return DtypeChoice(getattr(torch, kept["dtype"]), f"{kept['reason']}, kept from an earlier start")
    choice = timed_choice(flag, hidden, intermediate)
    write_kept(path, {"dtype": str(choice.dtype).removeprefix("torch."), "reason": choice.reason})
    return choice


def timed_choice(flag: str, hidden: int, intermediate: int) -> DtypeChoice:
    timed = projection_seconds(hidden, intermediate)
    f32_s = timed[ROWS[-1]][0]
    if f32_s < MIN_TIMED_S:
        return DtypeChoice(
            torch.float32,
            f"auto: float32 (the CPU has {flag}, but the model's projections are too small for bfloat16 to pay:"
            f" {f32_s * 1e6:.0f} us in float32)",
        )
    speedups = {rows: f / max(b, 1e-9) for rows, (f, b) in timed.items()}
    measured = ", ".join(f"{x:.2f}x at {rows} row{'s' if rows > 1 else ''}" for rows, x in speedups.items())
    if min(speedups.values()) < MIN_SPEEDUP:
        return DtypeChoice(
            torch.float32,
            f"auto: float32 (the CPU has {flag}, but bfloat16 projections measured only {measured} float32)",
        )
    return DtypeChoice(
        torch.bfloat16,
        f"auto: bfloat16 (the CPU has {flag}; bfloat16 projections measured {measured} float32)",
    )
