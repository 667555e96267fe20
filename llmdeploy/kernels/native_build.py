"""The compiled CPU kernels' library (kernels/csrc/*.c): built at first use with the system C compiler (`gcc -O3
-march=native -fopenmp`, one compiler process a source, about 25 s on two cores, no torch headers) into
$LLMDEPLOY_CACHE_DIR/kernels/, keyed by the source, the flags, the compiler and the CPU, loaded with ctypes, and
configured from the environment (the measured row thresholds below). The library's OpenMP is the libgomp torch has
already loaded (same soname), so its loops use torch's threads. No compiler, a failed build, or
LLMDEPLOY_NATIVE_KERNELS=0: library() is None (logged once), and every wrapper (cpu_native, native_attention,
native_quant, decode_step) answers None so its caller keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import torch

from llmdeploy.kernels.cpu_flags import cpuinfo_lines

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / name
    for name in (
        "cpu_kernels.c",
        "decode_attention.c",
        "decode_attention_avx512.c",
        "fused_ops.c",
        "linear_avx512.c",
        "q_linear.c",
        "f32_linear_avx2.c",
        "bf16_linear_avx2.c",
        "q_linear_avx2.c",
        "qv_linear_avx2.c",
        "amx_linear.c",
        "prefill_attention.c",
        "prefill_attention_f32.c",
        "decode_step.c",
        "argmax.c",
        "sample_rows.c",
        "head_screen.c",
    )
)
# in the build key too: a change to one rebuilds
HEADERS = tuple(
    CSRC / name
    for name in (
        "unroll.h",
        "prefetch.h",
        "avx512_exp.h",
        "avx2_tiles.h",
        "avx2_side_walk.h",
        "avx2_exp.h",
        "avx2_reduce.h",
        "row_chunk.h",
        "lanes.h",
        "bf16_lanes.h",
        "q_format.h",
        "tile_groups.h",
        "head_screen.h",
    )
)
# -ffp-contract=off: a * b + c written as two ops stays two roundings, as torch computes it (rotary, norms)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=off")
ENV_SWITCH = "LLMDEPLOY_NATIVE_KERNELS"
AMX_ENV = "LLMDEPLOY_AMX_MIN_ROWS"
AMX_MIN_ROWS_DEFAULT = 4  # bench/linear_rows.py on a Xeon with AMX: tied with vdpbf16ps at 2 rows, 0.87x at 4
AHEAD_ENV = "LLMDEPLOY_TILE_AHEAD_ROWS"
# float32 linears (and the AVX2 bf16 one's widened tiles) up to this many rows prefetch the next weight tile during a
# tile's later walks; bench/linear_rows.py times it on and off (Zen 2, AVX2: the 30 layers' projections at 32 rows in
# a decode step 64.4 -> 47.6 ms)
TILE_AHEAD_ROWS_DEFAULT = 64
STREAMS_ENV = "LLMDEPLOY_ROW_STREAMS"
# weight tiles a float32 or bf16 linear reads side by side for one row (1-3; 1: a tile at a time; csrc/tile_groups.h):
# bench/linear_rows.py times them against one at one row. The AVX2 kernels take 3 (Zen 2: a step's 538 MB of weights
# 23.3 -> 17.0 ms with 3, 2 tiles 16.5-16.7 against 3 tiles' 14.2-15.2 in a harness; batch-1 decode 23.1 -> 16.5
# ms/token); the AVX-512 ones 2 (Zen 4, bf16 batch-1 engine steps alternating in one process, five runs: 2 streams
# 5-10% faster than 3, float32 even; the kernel alone even): row_streams() picks.
ROW_STREAMS_AVX2 = 3
ROW_STREAMS_AVX512 = 2
SIDE_ROWS_ENV = "LLMDEPLOY_SIDE_ROWS"
# rows up to which the AVX2 float32 and bf16 linears read those tiles side by side too, a few rows at a time (0-16;
# csrc/f32_linear_avx2.c rows_tiles). Zen 2, engine decode steps, this walk vs the one-tile walk in one process:
# batch 3 28 -> 20 ms, 4 29 -> 23, 8 36 -> 29, 12 42 -> 40-43 (even), 16 slower; bf16 at 2-8 rows 0.61-0.66x its
# widened-tile walk's time; bench/linear_rows.py times both to 12 rows
SIDE_ROWS_DEFAULT = 12
BUILD_TIMEOUT_S = 120
c_int64, c_ptr, c_float, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
# argument lists shared by a kernel's float32 and bfloat16 variants
LINEAR_ARGS = [c_ptr, c_int64, c_ptr, c_ptr, c_ptr, c_int64, c_int64, c_int64, c_int]
NORM_ARGS = [c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, c_int64, c_int64, c_float, c_int]
ROPE_ARGS = [c_ptr, c_int64, c_int64, c_int64, c_int64, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, c_int]
Q_LINEAR_ARGS = [c_int, c_ptr, c_int64, c_ptr, c_ptr, c_ptr, c_int64, c_int64, c_int64, c_int]
# q, its row stride, K and V caches, block tables, their row stride, context lengths, out, B, H, Hkv, D, block size,
# scale, threads
DECODE_ARGS = [c_ptr, c_int64, c_ptr, c_ptr, c_ptr, c_int64, c_ptr, c_ptr, *[c_int64] * 5, c_float, c_int]
SIGNATURES = {
    "llmd_has_avx2": [],
    "llmd_has_avx512": [],
    "llmd_has_f32_linear": [],
    "llmd_has_f32_linear_avx2": [],
    "llmd_has_avx512_bf16": [],
    "llmd_has_bf16_linear": [],
    "llmd_has_bf16_linear_avx2": [],
    "llmd_f32_pack": [c_ptr, c_int64, c_int64, c_ptr, c_int],
    "llmd_f32_linear": LINEAR_ARGS,
    "llmd_f32_linear_avx2": LINEAR_ARGS,
    "llmd_bf16_pack": [c_ptr, c_int64, c_int64, c_ptr, c_int],
    "llmd_bf16_linear": LINEAR_ARGS,
    # x, x_stride, packed, y (float32), M, N, K, nthreads: the head screen's sums
    "llmd_bf16_linear_f32out": [c_ptr, c_int64, c_ptr, c_ptr, c_int64, c_int64, c_int64, c_int],
    "llmd_bf16_linear_avx2": LINEAR_ARGS,
    "llmd_amx_configure": [c_int],
    "llmd_tile_ahead_configure": [c_int],
    "llmd_row_streams_configure": [c_int],
    "llmd_side_rows_configure": [c_int],
    "llmd_paged_decode_attention": [*DECODE_ARGS[:4], c_int, *DECODE_ARGS[4:]],  # c_int: the cache is bf16
    "llmd_paged_decode_attention_bf16io": DECODE_ARGS,  # bf16 queries, cache and output
    **{
        f"llmd_paged_prefill_attention_{name}": [
            c_ptr,
            c_int64,
            c_ptr,
            c_ptr,
            c_ptr,
            c_int64,
            c_int64,
            c_int64,
            c_ptr,
            c_int64,
            c_int64,
            c_int64,
            c_float,
            c_int,
        ]
        for name in ("bf16", "f32", "bf16_avx2")
    },
    "llmd_has_avx512_vnni": [],
    "llmd_has_qv_linear": [],
    "llmd_qv_exact_min_rows": [],
    "llmd_q_pack": [c_int, c_int, c_ptr, c_ptr, c_ptr, c_int64, c_int64, c_ptr],
    "llmd_q_linear": Q_LINEAR_ARGS,
    "llmd_q_linear_avx2": Q_LINEAR_ARGS,
    "llmd_has_q_linear_avx2": [],
    "llmd_qv_linear": Q_LINEAR_ARGS,
    "llmd_q_bf16_linear": Q_LINEAR_ARGS,
    "llmd_q_unpack": [c_int, c_int, c_ptr, c_int64, c_int64, c_ptr],
    "llmd_add_rms_norm": NORM_ARGS,
    "llmd_add_rms_norm_bf16": NORM_ARGS,
    "llmd_silu_mul": [c_ptr, c_ptr, c_int64, c_int64, c_int],
    "llmd_silu_mul_bf16": [c_ptr, c_ptr, c_int64, c_int64, c_int],
    # decode_step.c: act_bf16, n_layers, layers, final_norm, hidden, residual, M, E, H, Hkv, D, I, eps,
    # positions, cos_sin, max_pos, slots, tables, bt_stride, lens, block_size, scale, q_bf16_min_rows, nthreads
    "llmd_decode_layers": [c_int, c_int64, *[c_ptr] * 4, *[c_int64] * 6, c_float, c_ptr, c_ptr, c_int64]
    + [c_ptr, c_ptr, c_int64, c_ptr, c_int64, c_float, c_int64, c_int],
    # act_bf16, n_layers, layers, final_norm, embed, vocab, ids, head, logits, then as llmd_decode_layers from M
    "llmd_decode_logits": [c_int, c_int64, *[c_ptr] * 3, c_int64, *[c_ptr] * 3, *[c_int64] * 6, c_float]
    + [c_ptr, c_ptr, c_int64, c_ptr, c_ptr, c_int64, c_ptr, c_int64, c_float, c_int64, c_int],
    # act_bf16, n_layers, layers, final_norm, embed, vocab, ids, head, screen, tokens, steps, yield_flag, done,
    # screened, then as llmd_decode_layers from M without slots (each step's come from the tables)
    "llmd_decode_greedy": [c_int, c_int64, *[c_ptr] * 3, c_int64, *[c_ptr] * 4, c_int64, *[c_ptr] * 4]
    + [*[c_int64] * 6, c_float]
    + [c_ptr, c_ptr, c_int64, c_ptr, c_int64, c_ptr, c_int64, c_float, c_int64, c_int],
    # screen, act_bf16, head_w, V, K, x, M, best, tiles_read, nthreads
    "llmd_head_screen_argmax": [c_ptr, c_int, c_ptr, c_int64, c_int64, c_ptr, c_int64, c_ptr, c_ptr, c_int],
    "llmd_head_screen_takes": [c_ptr, c_int, c_int64],
    "llmd_rope_store": ROPE_ARGS,
    "llmd_argmax_rows": [c_ptr, c_int64, c_int64, c_int64, c_ptr, c_int],
    # x, rows, n, stride, inv_temp, min_p, u, out, nthreads
    "llmd_sample_rows": [c_ptr, c_int64, c_int64, c_int64, c_ptr, c_ptr, c_ptr, c_ptr, c_int],
    # x, rows, n, stride, top_k, top_p, inv_temp (may be NULL), nthreads
    "llmd_top_k_top_p_rows": [c_ptr, c_int64, c_int64, c_int64, c_ptr, c_ptr, c_ptr, c_int],
    "llmd_rope_store_bf16": ROPE_ARGS,
}


class NativeBuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    from llmdeploy.engine.weights_cache import cache_root  # the engine's cache root, one definition

    return cache_root() / "kernels"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build_key(cc: str, flags: tuple[str, ...]) -> str:
    """Source, flags, compiler version and CPU (-march=native code is only valid on CPUs like this one)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    cpu = "\n".join(cpuinfo_lines("model name", "flags", "Features")) or platform.processor()
    ident = "\0".join([*(src.read_text() for src in (*SOURCES, *HEADERS)), " ".join(flags), version, cpu])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def build(flags: tuple[str, ...] = FLAGS, out_dir: Path | None = None) -> Path:
    """The compiled library, built once per key; written to a temporary name and renamed into place, so a
    concurrent start sees no file or a complete one."""
    cc = compiler()
    if cc is None:
        raise NativeBuildError("no C compiler (gcc or cc) on PATH")
    out_dir = out_dir or cache_dir()
    target = out_dir / f"cpu_kernels-{build_key(cc, flags)}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{target.stem}.{uuid.uuid4().hex}.so"
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="llmdeploy-kernels-") as objects:
        compile_flags = [f for f in flags if f != "-shared"]
        objs = [str(Path(objects) / f"{src.stem}.o") for src in SOURCES]
        compiles = [
            [cc, *compile_flags, "-c", str(src), "-o", obj] for src, obj in zip(SOURCES, objs, strict=True)
        ]
        try:
            _run_side_by_side(compiles, deadline)
            _run_side_by_side([[cc, *flags, "-o", str(tmp), *objs, "-lm"]], deadline)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    os.replace(tmp, target)
    return target


def _run_side_by_side(commands: list[list[str]], deadline: float) -> None:
    """Runs the compiler commands at once (one a source: the build takes about its slowest source, 23 s of 41 on
    two cores, instead of their sum); NativeBuildError with the first failure's messages."""
    procs: list[subprocess.Popen] = []
    try:
        for cmd in commands:
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        errors = [proc.communicate(timeout=max(0.0, deadline - time.monotonic()))[1] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for cmd, proc, err in zip(commands, procs, errors, strict=True):
        if proc.returncode != 0:
            raise NativeBuildError(f"{cmd[0]} failed: {err.strip()[-2000:]}")


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, c_int
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        lib = load(build())
    except (OSError, subprocess.SubprocessError, NativeBuildError) as exc:
        log.warning("native CPU kernels unavailable, using the torch ops instead: %s", exc)
        return None
    amx = lib.llmd_amx_configure(amx_min_rows())
    lib.llmd_tile_ahead_configure(env_rows(AHEAD_ENV, TILE_AHEAD_ROWS_DEFAULT))
    lib.llmd_row_streams_configure(row_streams(lib))
    lib.llmd_side_rows_configure(env_rows(SIDE_ROWS_ENV, SIDE_ROWS_DEFAULT))
    log.info(
        "native CPU kernels loaded (%s%s)",
        "AVX2" if lib.llmd_has_avx2() else "portable C",
        f", bf16 linear on AMX from {amx} rows" if amx else "",
    )
    return lib


def env_rows(name: str, default: int) -> int:
    """A row-count setting from the environment, >= 0; a bad value is logged and the default kept."""
    raw = os.environ.get(name, str(default))
    try:
        return max(0, int(raw))
    except ValueError:
        log.warning("%s=%r is not a row count; using %d", name, raw, default)
        return default


def amx_min_rows() -> int:
    """From how many rows a bf16 linear runs on AMX tiles instead of vdpbf16ps (kernels/csrc/amx_linear.c):
    LLMDEPLOY_AMX_MIN_ROWS, 0 = never (the benchmarks' baseline); the default is measured (bench/linear_rows.py)."""
    return env_rows(AMX_ENV, AMX_MIN_ROWS_DEFAULT)


def amx_linear_rows() -> int:
    """The row count from which bf16 linears run on AMX here, 0 where they never do (no AMX, or switched off)."""
    lib = library()
    return 0 if lib is None else lib.llmd_amx_configure(amx_min_rows())


def amx_can_run() -> bool:
    """Whether the AMX linear can run here at all (AMX-BF16 and Linux's grant), whatever the row setting says."""
    lib = library()
    if lib is None:
        return False
    can = lib.llmd_amx_configure(1) > 0
    lib.llmd_amx_configure(amx_min_rows())
    return can


def row_streams(lib) -> int:
    """Tiles a one-row linear reads side by side: LLMDEPLOY_ROW_STREAMS, else what the kernels this CPU runs took."""
    return env_rows(STREAMS_ENV, ROW_STREAMS_AVX512 if lib.llmd_has_avx512() else ROW_STREAMS_AVX2)


def available() -> bool:
    return library() is not None


def threads() -> int:
    return max(1, torch.get_num_threads())
