"""Compiled CPU kernels (kernels/csrc/*.c) behind plain Python functions, with None as the answer
wherever they do not apply, so callers keep their torch path.

Built at first use with the system C compiler (`gcc -O3 -march=native -fopenmp`, one compiler process a source,
about 25 s on two cores, no torch headers) into $LLMDEPLOY_CACHE_DIR/kernels/, keyed by the source, the flags, the
compiler and the CPU, and loaded with ctypes. The library's OpenMP is the libgomp torch has already loaded (same
soname), so its loops use torch's threads. No compiler, a failed build, or LLMDEPLOY_NATIVE_KERNELS=0: every
function returns None (logged once).
"""

from __future__ import annotations

import ctypes
import enum
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
from dataclasses import dataclass
from pathlib import Path

import torch

from llmdeploy.kernels.huge_pages import huge_empty

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name("csrc") / name
    for name in (
        "cpu_kernels.c",
        "decode_attention.c",
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
    )
)
# in the build key too: a change to one rebuilds
HEADERS = tuple(
    Path(__file__).with_name("csrc") / name
    for name in (
        "unroll.h",
        "avx2_tiles.h",
        "avx2_side_walk.h",
        "avx2_exp.h",
        "avx2_reduce.h",
        "row_chunk.h",
        "lanes.h",
        "bf16_lanes.h",
        "q_format.h",
        "tile_groups.h",
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
SIGNATURES = {
    "llmd_has_avx2": [],
    "llmd_has_avx512": [],
    "llmd_has_f32_linear": [],
    "llmd_has_f32_linear_avx2": [],
    "llmd_has_avx512_bf16": [],
    "llmd_has_bf16_linear": [],
    "llmd_has_bf16_linear_avx2": [],
    "llmd_f32_pack": [c_ptr, c_int64, c_int64, c_ptr],
    "llmd_f32_linear": LINEAR_ARGS,
    "llmd_f32_linear_avx2": LINEAR_ARGS,
    "llmd_bf16_pack": [c_ptr, c_int64, c_int64, c_ptr],
    "llmd_bf16_linear": LINEAR_ARGS,
    "llmd_bf16_linear_avx2": LINEAR_ARGS,
    "llmd_amx_configure": [c_int],
    "llmd_tile_ahead_configure": [c_int],
    "llmd_row_streams_configure": [c_int],
    "llmd_side_rows_configure": [c_int],
    "llmd_paged_decode_attention": [
        c_ptr,
        c_int64,
        c_ptr,
        c_ptr,
        c_int,
        c_ptr,
        c_int64,
        c_ptr,
        c_ptr,
        c_int64,
        c_int64,
        c_int64,
        c_int64,
        c_int64,
        c_float,
        c_int,
    ],
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
    # act_bf16, n_layers, layers, final_norm, embed, vocab, ids, head, tokens, steps, yield_flag, done, then as
    # llmd_decode_layers from M without slots (each step's come from the tables)
    "llmd_decode_greedy": [c_int, c_int64, *[c_ptr] * 3, c_int64, *[c_ptr] * 3, c_int64, c_ptr, c_ptr]
    + [*[c_int64] * 6, c_float]
    + [c_ptr, c_ptr, c_int64, c_ptr, c_int64, c_ptr, c_int64, c_float, c_int64, c_int],
    "llmd_rope_store": ROPE_ARGS,
    "llmd_argmax_rows": [c_ptr, c_int64, c_int64, c_int64, c_ptr, c_int],
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
    try:
        cpu = "\n".join(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith(("model name", "flags", "Features"))
        )
    except OSError:
        cpu = platform.processor()
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


def row_streams(lib) -> int:
    """Tiles a one-row linear reads side by side: LLMDEPLOY_ROW_STREAMS, else what the kernels this CPU runs took."""
    return env_rows(STREAMS_ENV, ROW_STREAMS_AVX512 if lib.llmd_has_avx512() else ROW_STREAMS_AVX2)


def available() -> bool:
    return library() is not None


def _threads() -> int:
    return max(1, torch.get_num_threads())


# paged_attention_decode's signature (kernels/reference.py), declared again by each backend that implements it
def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """paged_attention_decode with K/V read in place from the cache; None where the kernel does not apply."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if (
        query.device.type != "cpu"
        or k_cache.dtype not in (torch.float32, torch.bfloat16)
        or v_cache.dtype != k_cache.dtype
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or head_dim % 8
        or num_heads % num_kv_heads
        or num_seqs == 0
    ):
        return None
    lib = library()
    if lib is None:
        return None
    q = query if query.dtype == torch.float32 else query.float()
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty(num_seqs, num_heads, head_dim)
    rc = lib.llmd_paged_decode_attention(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        int(k_cache.dtype == torch.bfloat16),
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        k_cache.shape[1],
        scale,
        _threads(),
    )
    if rc != 0:
        return None
    return out if query.dtype == torch.float32 else out.to(query.dtype)


# the prefill attention kernels per cache dtype, first choice first, each with the probe saying whether this build
# has its instructions: bf16 (prefill_attention.c, AVX-512 BF16; else prefill_attention_f32.c widening it, AVX2 +
# FMA), float32 (prefill_attention_f32.c)
PREFILL_KERNELS = {
    torch.bfloat16: (
        ("llmd_paged_prefill_attention_bf16", "llmd_has_avx512_bf16"),
        ("llmd_paged_prefill_attention_bf16_avx2", "llmd_has_avx2"),
    ),
    torch.float32: (("llmd_paged_prefill_attention_f32", "llmd_has_avx2"),),
}


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor | None:
    """One sequence's prefill chunk, query [n, H, D] (the last n of context_len positions, their K/V stored) against
    its cache read in place, query and cache both bf16 or both float32; None where no kernel applies (another
    dtype, a CPU without the kernel's instructions, a head dim it does not take), so the caller keeps the torch
    path."""
    n, num_heads, head_dim = query.shape
    if (
        query.dtype not in PREFILL_KERNELS
        or query.device.type != "cpu"
        or k_cache.dtype != query.dtype
        or v_cache.dtype != query.dtype
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or not 0 < n <= context_len
    ):
        return None
    lib = library()
    kernels = [k for k, probe in PREFILL_KERNELS[query.dtype] if lib and getattr(lib, probe)()]
    if not kernels:  # not on this CPU: no allocation per sequence and layer
        return None
    q = query if query.stride(2) == 1 and query.stride(1) == head_dim else query.contiguous()
    table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    table = table.contiguous()
    out = torch.empty(n, num_heads, head_dim, dtype=query.dtype)
    args = (
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        table.data_ptr(),
        k_cache.shape[1],
    )
    for kernel in kernels:  # the next where one declines the shape (AVX-512 BF16's takes head dims of 64s)
        rc = getattr(lib, kernel)(
            *args, n, context_len, out.data_ptr(), num_heads, k_cache.shape[2], head_dim, scale, _threads()
        )
        if rc == 0:
            return out
    return None


def _linear_rows(x: torch.Tensor, n: int, kernel) -> torch.Tensor | None:
    """x[..., K] as rows with unit stride -> out [..., n] of x's dtype from kernel(rows, out) (0 on success)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype)
    if rows.shape[0] and kernel(rows, out) != 0:
        return None
    return out.view(*x.shape[:-1], n)


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


class QFormat(enum.IntEnum):
    """GGUF's block-quantized weight formats the native kernel reads (fmt in q_format.h)."""

    Q8 = 0  # w = d * q, q int8, one float16 d per block (GGUF Q8_0; model.quantization int8)
    Q4 = 1  # w = d * q + m, q in 0..15, float16 d and m per block (GGUF Q4_1; Q4_0 is m = -8 d)


Q_BLOCK, Q_TILE = 32, 32  # inputs per block (GGUF's QK), channels per packed tile (QB, Q_NR in q_format.h)


def q_packed_bytes(fmt: QFormat, n: int, k: int) -> int:
    per_block = 2 * 64 + Q_BLOCK * 16 if fmt == QFormat.Q4 else 64 + Q_BLOCK * 32
    return -(-n // Q_TILE) * (k // Q_BLOCK) * per_block


@dataclass(frozen=True)
class QPacked:
    """A block-quantized weight in one of the kernel's layouts: `vnni` = llmd_qv_* (int8 dot products, x rounded
    to int8 per block), else llmd_q_* (float32 products of the exact weights)."""

    data: torch.Tensor  # uint8
    fmt: QFormat
    vnni: bool
    out_features: int
    in_features: int


def q_vnni_available() -> bool:
    """Whether the VNNI layout's kernel runs here (AVX-512 VNNI, or AVX2's multiply-add pairs in the same integer
    sums and float steps, below qv_exact_min_rows rows); LLMDEPLOY_QUANT_VNNI=0 keeps the float32 kernel."""
    lib = library()
    return (
        os.environ.get("LLMDEPLOY_QUANT_VNNI", "1") != "0"
        and lib is not None
        and bool(lib.llmd_has_qv_linear())
    )


def qv_exact_min_rows() -> int:
    """Rows from which the VNNI layout's kernel takes x as float32 against the exact weights (the float layout's
    bits at as many rows) instead of rounding it to int8: prefill on AVX2, where int8 products are no faster once
    compute-bound; 0 = never (AVX-512 VNNI rounds every row)."""
    lib = library()
    return int(lib.llmd_qv_exact_min_rows()) if lib is not None else 0


def q_pack(
    fmt: QFormat, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, vnni: bool | None = None
) -> QPacked | None:
    """q [N, K] (int8; Q4: uint8 0..15), d and m [N, K / 32] float16 -> the kernel's byte layout (tiles of 32
    channels, per block their scales then their quants; `vnni`: default where it runs), or None where no kernel
    applies."""
    lib = library()
    n, k = q.shape
    if lib is None or k % Q_BLOCK or d.shape != (n, k // Q_BLOCK) or d.dtype != torch.float16:
        return None
    if fmt == QFormat.Q4 and (m is None or m.shape != d.shape or m.dtype != torch.float16):
        return None
    vnni = q_vnni_available() if vnni is None else vnni
    q, d = q.contiguous(), d.contiguous()
    m = m.contiguous() if m is not None else None
    data = huge_empty(q_packed_bytes(fmt, n, k), torch.uint8)
    rc = lib.llmd_q_pack(int(fmt), int(vnni), q.data_ptr(), d.data_ptr(), _ptr(m), n, k, data.data_ptr())
    return QPacked(data, fmt, vnni, n, k) if rc == 0 else None


def q_unpack(packed: QPacked) -> torch.Tensor:
    """The packed weight as float32 [N, K], as a dequantizing loader computes it."""
    out = torch.empty(packed.out_features, packed.in_features)
    fmt, n, k = int(packed.fmt), packed.out_features, packed.in_features
    if library().llmd_q_unpack(fmt, int(packed.vnni), packed.data.data_ptr(), n, k, out.data_ptr()) != 0:
        raise ValueError(f"cannot unpack a {packed.fmt.name} weight of {n} x {k}")
    return out


# Rows from which the float kernel's layout runs as bf16 products of a once-dequantized tile (llmd_q_bf16_linear,
# AVX-512 BF16) instead of float32 ones of the exact weights: where the float32 kernel stops being bandwidth-bound.
# Zen 4, SmolLM2 int8 decode steps alternating in one process: 8 requests 18.1-21.1 ms from 8 rows, 16.4-18.6 from
# 12 (even at 10-12, the bf16 path ahead at 16: 28.5 vs 31.8 ms); it was 8.
Q_BF16_MIN_ROWS = 12


def q_linear(x: torch.Tensor, packed: QPacked, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x[..., K] float32 @ w[N, K]^T + bias (float32) -> [..., N] float32, w as q_pack made it; None if the kernel
    does not apply. VNNI layout: x rounded to int8 per block (llama.cpp's way); float layout: exact weights times
    float32 x below Q_BF16_MIN_ROWS rows, bf16-rounded weights and x (float32 sums) from there where the CPU has
    AVX-512 BF16."""
    lib = library()
    n, k = packed.out_features, packed.in_features
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
        return None
    rows = x.numel() // k if k else 0
    if packed.vnni:
        kernel = lib.llmd_qv_linear
    elif rows >= Q_BF16_MIN_ROWS and lib.llmd_has_avx512_bf16():
        kernel = lib.llmd_q_bf16_linear
    else:
        kernel = lib.llmd_q_linear
    return _linear_rows(
        x,
        n,
        lambda rows, out: kernel(
            int(packed.fmt),
            rows.data_ptr(),
            rows.stride(0),
            packed.data.data_ptr(),
            _ptr(bias),
            out.data_ptr(),
            rows.shape[0],
            n,
            k,
            _threads(),
        ),
    )


F32_TILE = 32  # output channels per packed tile (F32_NR in linear_avx512.c)


def _native_linear_runs(probe: str) -> bool:
    """The library is built with the instructions `probe` reports, and LLMDEPLOY_NATIVE_LINEAR=0 (keep oneDNN's
    GEMM: the benchmarks' baseline) is not set."""
    if os.environ.get("LLMDEPLOY_NATIVE_LINEAR", "1") == "0":
        return False
    lib = library()
    return lib is not None and bool(getattr(lib, probe)())


def f32_linear_available() -> bool:
    """Whether the native float32 linear runs here (AVX-512, or AVX2 + FMA; elsewhere oneDNN's packed GEMM stays)."""
    return _native_linear_runs("llmd_has_f32_linear")


def f32_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """float32 [N, K] -> the native linear's layout (tiles of F32_TILE channels, k-major), or None."""
    if not f32_linear_available() or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    n, k = weight.shape
    w = weight.detach().contiguous()
    packed = huge_empty(-(-n // F32_TILE) * F32_TILE * k, torch.float32)
    return packed if library().llmd_f32_pack(w.data_ptr(), n, k, packed.data_ptr()) == 0 else None


def _packed_linear(
    kernel: str, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor | None:
    """x[..., K] @ weight[n, K]^T + bias through `kernel` (llmd_f32_linear or llmd_bf16_linear), everything in
    packed's dtype; None if it does not apply."""
    lib = library()
    k = x.shape[-1]
    if lib is None or x.dtype != packed.dtype or x.device.type != "cpu" or packed.numel() % k:
        return None
    if bias is not None and bias.dtype != packed.dtype:
        return None
    return _linear_rows(
        x,
        n,
        lambda rows, out: getattr(lib, kernel)(
            rows.data_ptr(),
            rows.stride(0),
            packed.data_ptr(),
            _ptr(bias),
            out.data_ptr(),
            rows.shape[0],
            n,
            k,
            _threads(),
        ),
    )


def f32_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor | None:
    """x[..., K] float32 @ weight[n, K]^T + bias, the weight as f32_pack made it; None if it does not apply."""
    return _packed_linear("llmd_f32_linear", x, packed, bias, n)


def bf16_linear_available() -> bool:
    """Whether the native bfloat16 linear runs here: AVX-512 BF16's vdpbf16ps, or AVX2 + FMA widening each weight
    to float32 with vdpbf16ps's arithmetic (csrc/bf16_linear_avx2.c)."""
    return _native_linear_runs("llmd_has_bf16_linear")


def avx512_bf16_available() -> bool:
    """Whether the kernels built here have AVX-512 BF16's instructions (the bf16 prefill attention, the many-row
    block-quantized linear's bf16 products, AMX's neighbour)."""
    lib = library()
    return lib is not None and bool(lib.llmd_has_avx512_bf16())


def bf16_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """bfloat16 [N, K] (K even) -> the native bf16 linear's layout (tiles of F32_TILE channels, input pairs), or
    None."""
    if (
        not bf16_linear_available()
        or weight.dtype != torch.bfloat16
        or weight.dim() != 2
        or weight.shape[1] % 2
    ):
        return None
    n, k = weight.shape
    w = weight.detach().contiguous()
    packed = huge_empty(-(-n // F32_TILE) * F32_TILE * k, torch.bfloat16)
    return packed if library().llmd_bf16_pack(w.data_ptr(), n, k, packed.data_ptr()) == 0 else None


def bf16_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor | None:
    """x[..., K] bfloat16 @ weight[n, K]^T + bias -> bfloat16 (float32 sums, one rounding), the weight as
    bf16_pack made it; None if it does not apply (odd K among them)."""
    if x.shape[-1] % 2:
        return None
    return _packed_linear("llmd_bf16_linear", x, packed, bias, n)


def native_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in its dtype's native linear layout (f32_pack, bf16_pack), or None where none applies."""
    return bf16_pack(weight) if weight.dtype == torch.bfloat16 else f32_pack(weight)


def native_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor | None:
    """f32_linear or bf16_linear by the packed weight's dtype; None if it does not apply."""
    return (bf16_linear if packed.dtype == torch.bfloat16 else f32_linear)(x, packed, bias, n)


ROW_DTYPES = (torch.float32, torch.bfloat16)  # what the norm and rotary kernels take (bf16: `_bf16` variants)


def _rows_of(dtype: torch.dtype, *tensors: torch.Tensor | None) -> bool:
    """All CPU tensors of `dtype` (float32 or bfloat16), rows contiguous, outside torch.compile."""
    if torch.compiler.is_compiling() or dtype not in ROW_DTYPES:
        return False
    return all(
        t is None or (t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()) for t in tensors
    )


def _variant(lib: ctypes.CDLL, name: str, dtype: torch.dtype):
    return getattr(lib, name + "_bf16" if dtype == torch.bfloat16 else name)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + residual) normalised times weight, and x + residual, in one pass; None if not applicable."""
    dim = x.shape[-1]
    if (
        dim % 8
        or not _rows_of(x.dtype, x, weight, residual)
        or weight.shape != (dim,)
        or (residual is not None and residual.shape != x.shape)
    ):
        return None
    lib = library()
    if lib is None:
        return None
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    rc = _variant(lib, "llmd_add_rms_norm", x.dtype)(
        x.data_ptr(),
        residual.data_ptr() if residual is not None else None,
        weight.data_ptr(),
        out.data_ptr(),
        summed.data_ptr(),
        x.numel() // dim,
        dim,
        eps,
        _threads(),
    )
    return (out, summed) if rc == 0 else None


def argmax_rows(logits: torch.Tensor) -> list[int] | None:
    """logits.argmax(-1).tolist() for float32 [rows, n] on CPU (first index of the largest; NaN largest), or None
    where it does not apply."""
    if (
        logits.dim() != 2
        or logits.dtype != torch.float32
        or logits.device.type != "cpu"
        or logits.stride(1) != 1
        or logits.shape[1] == 0
        or torch.compiler.is_compiling()
    ):
        return None
    lib = library()
    if lib is None:
        return None
    rows = logits.shape[0]
    out = (ctypes.c_int64 * rows)()
    rc = lib.llmd_argmax_rows(logits.data_ptr(), rows, logits.shape[1], logits.stride(0), out, _threads())
    return list(out) if rc == 0 else None


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """x = [gate | up] along the last dim -> silu(gate) * up; None if not applicable."""
    inter = x.shape[-1] // 2
    if inter % 8 or not _rows_of(torch.float32, x):  # bf16: torch's two vectorised ops were faster
        return None
    lib = library()
    if lib is None:
        return None
    out = torch.empty(*x.shape[:-1], inter)
    rc = lib.llmd_silu_mul(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], inter, _threads())
    return out if rc == 0 else None


def rope_and_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> bool:
    """Rotates q and k in place in the fused qkv rows [N, H + 2 Hkv, D] by this step's cos/sin ([N, 1, D],
    reference.rotary_tables) and stores k, v into the caches at slot_mapping (-1: skipped). False (nothing done)
    where it does not apply; the caller then runs the torch ops."""
    n = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    if (
        head_dim % 16
        or qkv.shape[1:] != (num_heads + 2 * num_kv_heads, head_dim)
        or cos.shape != (n, 1, head_dim)
        or not _rows_of(qkv.dtype, qkv, k_cache, v_cache)
        or not _rows_of(torch.float32, cos, sin)
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
    ):
        return False
    lib = library()
    if lib is None:
        return False
    rc = _variant(lib, "llmd_rope_store", qkv.dtype)(
        qkv.data_ptr(),
        n,
        num_heads,
        num_kv_heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        slot_mapping.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        _threads(),
    )
    return rc == 0
