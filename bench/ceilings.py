"""The machine's ceilings for a decoder model, measured in the running process, and the floors they put under
the engine's figures (issue 13): GEMM GFLOP/s at the model's own shapes per dtype, memory read bandwidth, and

  W output tok/s ceiling = W's output tokens / (W's FLOPs / GEMM peak)         (compute bound)
  W roofline ceiling     = the same, each batch decode step at the larger of its FLOPs at the GEMM peak and its
                           bytes (weights + the batch's K/V) at the read bandwidth (AMX: decode is bandwidth bound)
  batch-1 decode floor   = weight bytes read per step / read bandwidth         (bandwidth bound; the read
                           bandwidth is the best of torch's sum and bench/csrc/read_probe.c with 1-8 streams a thread)
  TTFT floor             = FLOPs of one prompt's prefill / GEMM peak           (compute bound)

    python bench/ceilings.py [--dtypes float32,bfloat16] [--json out.json]     # ~10-30 s

The GEMM peak is the fastest of torch's two CPU paths (MKL `F.linear`, oneDNN packed weights) and this project's
native kernel (kernels/cpu_native.py, where it runs at that dtype) at 4096 rows x the MLP's shape; the per-shape
rates (1, 32 and 2048 rows over all projections and the LM head) give a second, shape-aware compute floor that
small decode batches can actually approach. Every figure is the best of several repetitions: on a shared machine
the least disturbed one.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from llmdeploy.kernels import cpu_native, native_build
from llmdeploy.kernels.cpu_flags import cpu_flags, cpu_model
from llmdeploy.kernels.native_quant import Q_BLOCK

# CPU features that decide which kernels exist (bf16/int8 matmul units, vector width)
RELEVANT_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "avx_ne_convert",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
PEAK_ROWS = 4096
SHAPE_ROWS = (1, 32, 2048)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: tuple[str, ...]  # the RELEVANT_FLAGS this CPU has
    torch_capability: str
    threads: int
    load_avg: tuple[float, float, float]

    def line(self) -> str:
        return (
            f"CPU: {self.model} | flags: {' '.join(self.flags) or '-'} | torch {torch.__version__} "
            f"({self.torch_capability}) | {self.threads} threads | load average {self.load_avg[0]:.1f}"
        )


def cpu_info() -> CpuInfo:
    have = cpu_flags()
    return CpuInfo(
        cpu_model() or platform.processor() or "unknown",
        tuple(f for f in RELEVANT_FLAGS if f in have),
        torch.backends.cpu.get_cpu_capability(),
        torch.get_num_threads(),
        os.getloadavg(),
    )


@dataclass(frozen=True)
class ModelShape:
    """What the ceilings need to know about a Llama-family decoder."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> ModelShape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            config.num_hidden_layers,
            config.hidden_size,
            config.intermediate_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
            config.vocab_size,
        )

    def projections(self) -> list[tuple[int, int]]:
        """(in, out) of one layer's GEMMs as the engine runs them: fused qkv, o, fused gate|up, down."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [
            (self.hidden, q + 2 * kv),
            (q, self.hidden),
            (self.hidden, 2 * self.intermediate),
            (self.intermediate, self.hidden),
        ]

    @property
    def layer_params(self) -> int:
        return self.num_layers * sum(i * o for i, o in self.projections())

    @property
    def head_params(self) -> int:
        return self.hidden * self.vocab

    def weight_bytes(self, dtype: str) -> int:
        """Bytes a decode step reads: every projection and the LM head once (norms and the one embedding row
        are noise). int8 weights are GGUF Q8_0 blocks: a float16 scale per Q_BLOCK inputs of a channel."""
        params = self.layer_params + self.head_params
        scales = 2 * params // Q_BLOCK if dtype == "int8" else 0
        return params * DTYPE_BYTES[dtype] + scales

    def kv_bytes(self, context: int, dtype: str) -> int:
        """K and V of `context` tokens, all layers: what one sequence's decode attention reads. The cache holds
        the activations' dtype (int8 weights keep float32 activations)."""
        elem = DTYPE_BYTES["float32" if dtype == "int8" else dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * context * elem

    def attention_flops(self, context: int) -> int:
        """One query token over `context` keys, all layers (QK^T and PV)."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * context

    def prefill_flops(self, prompt_len: int) -> int:
        """One prompt: projections of every token, causal attention, logits of the last row only."""
        attn = sum(self.attention_flops(p + 1) for p in range(prompt_len))
        return 2 * self.layer_params * prompt_len + attn + 2 * self.head_params

    def decode_flops(self, context: int) -> int:
        return 2 * (self.layer_params + self.head_params) + self.attention_flops(context)

    def workload_flops(self, num_requests: int, prompt_len: int, output_len: int) -> tuple[int, int]:
        """(prefill, decode) FLOPs of a batch workload: every request prefilled, then output_len - 1 decodes."""
        prefill = num_requests * self.prefill_flops(prompt_len)
        decode = num_requests * sum(self.decode_flops(prompt_len + t + 1) for t in range(output_len - 1))
        return prefill, decode


def best_time(fn, budget_s: float = 0.6, min_reps: int = 3, max_reps: int = 50) -> float:
    """Fastest of repeated calls (after one warm-up), for about budget_s (at least 2 calls when they are slow)."""
    t = time.perf_counter()
    fn()
    if time.perf_counter() - t > budget_s:
        min_reps = 1
    best, reps, start = float("inf"), 0, time.perf_counter()
    while reps < min_reps or (reps < max_reps and time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        reps += 1
    return best


def onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed layout of the weight, or None where this CPU/dtype has no such path (bf16 without
    AVX-512)."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight)
    except (RuntimeError, AttributeError):
        return None


# A GEMM bigger than this many FLOPs is timed on fewer rows (the rate no longer depends on them): the LM head at
# 2048 rows is 116 GFLOP, seconds per call, and minutes where bf16 is emulated.
MAX_TIMED_FLOPS = 4e9


# At a few rows a GEMM reads its weight once per call: timed over distinct weights this large in all, so it streams
# them from memory as decode does (one cache-resident weight made the 1-row rate look like twice the bandwidth)
STREAM_BYTES, STREAM_ROWS = 64 << 20, 8


def gemm_gflops(rows: int, k: int, n: int, dtype: torch.dtype, budget_s: float = 0.6) -> dict[str, float]:
    """GFLOP/s of x[rows, k] @ w[n, k]^T by torch's MKL path, by oneDNN packed weights (where it exists) and by
    this project's native kernel (where it runs: on Zen 2 it beat both libraries, so a ceiling without it was no
    ceiling)."""
    rows = min(rows, max(256, int(MAX_TIMED_FLOPS / (2 * k * n))))
    x = torch.randn(rows, k, dtype=dtype)
    copies = max(1, STREAM_BYTES // (k * n * x.element_size())) if rows <= STREAM_ROWS else 1
    ws = [torch.randn(n, k, dtype=dtype) for _ in range(copies)]
    flops = 2 * rows * k * n * copies
    out = {"mkl": flops / best_time(lambda: [F.linear(x, w) for w in ws], budget_s) / 1e9}
    packed = [onednn_packed(w) for w in ws]
    if packed[0] is not None:
        run = lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed]  # noqa: E731
        out["onednn"] = flops / best_time(run, budget_s) / 1e9
    native = [cpu_native.native_pack(w) for w in ws]
    if native[0] is not None:
        run = lambda: [cpu_native.native_linear(x, p, None, n) for p in native]  # noqa: E731
        out["native"] = flops / best_time(run, budget_s) / 1e9
    return out


PROBE_SOURCE = Path(__file__).with_name("csrc") / "read_probe.c"
PROBE_STREAMS = (1, 2, 3, 4, 8)


@functools.cache
def read_probe() -> ctypes.CDLL | None:
    """bench/csrc/read_probe.c built for this CPU (as the engine builds its kernels), or None without a compiler."""
    cc = native_build.compiler()
    if cc is None:
        return None
    with tempfile.TemporaryDirectory(prefix="llmdeploy-probe-") as tmp:
        out = Path(tmp) / "read_probe.so"
        flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
        if subprocess.run([cc, *flags, "-o", str(out), str(PROBE_SOURCE)], capture_output=True).returncode:
            return None
        lib = ctypes.CDLL(str(out))  # mapped: the file can go
    lib.llmd_read_probe.restype = ctypes.c_double
    c_int = ctypes.c_int
    lib.llmd_read_probe.argtypes = [ctypes.c_void_p, ctypes.c_int64, c_int, c_int, c_int, ctypes.c_void_p]
    return lib


def read_bandwidth_gbps(mib: int = 512, budget_s: float = 1.0) -> float:
    """GB/s of reading a buffer far larger than the caches on torch's threads: the best of torch's sum (one stream
    a thread) and read_probe.c with 1-8 streams a thread (some CPUs' memory needs several to run at full speed: the
    engine's one-row linear reads three weight tiles at a time)."""
    buf = torch.ones(mib << 18)  # float32
    best = buf.numel() * 4 / best_time(lambda: buf.sum(), budget_s / 2) / 1e9
    probe = read_probe()
    if probe is not None:
        sink, reps = ctypes.c_float(0.0), 3
        for streams in PROBE_STREAMS:
            gbps = probe.llmd_read_probe(
                buf.data_ptr(), buf.numel(), streams, torch.get_num_threads(), reps, ctypes.byref(sink)
            )
            best = max(best, gbps)
    return best


@dataclass
class DtypeCeiling:
    dtype: str
    peak_gflops: float  # best path at PEAK_ROWS x hidden x intermediate
    peak_paths: dict[str, float]
    shape_gflops: dict[int, float] = field(default_factory=dict)  # rows -> FLOP-weighted over all GEMMs


def projection_rate(shape: ModelShape, rows: int, dtype: torch.dtype, budget_s: float) -> float:
    """GFLOP/s over one layer's projections and the LM head at `rows` rows, FLOP-weighted (total / time)."""
    gemms = [*shape.projections(), (shape.hidden, shape.vocab)]
    total_flops = total_s = 0.0
    for k, n in gemms:
        rate = max(gemm_gflops(rows, k, n, dtype, budget_s).values())
        flops = 2 * rows * k * n * (shape.num_layers if (k, n) != (shape.hidden, shape.vocab) else 1)
        total_flops += flops
        total_s += flops / (rate * 1e9)
    return total_flops / total_s / 1e9


def native_dtype(dtype: str, flags: tuple[str, ...]) -> bool:
    """bf16/fp16 matmuls run natively only with AVX-512 BF16/FP16 or AMX; elsewhere they are emulated and slow."""
    if dtype == "bfloat16":
        return bool({"avx512_bf16", "amx_bf16"} & set(flags))
    if dtype == "float16":
        return bool({"avx512_fp16", "amx_fp16"} & set(flags))
    return True


def measure_dtype(shape: ModelShape, dtype: str, quick: bool) -> DtypeCeiling:
    td = getattr(torch, dtype)
    budget = 0.3 if quick else 0.6
    peak_paths = gemm_gflops(PEAK_ROWS, shape.hidden, shape.intermediate, td, budget)
    ceiling = DtypeCeiling(dtype, max(peak_paths.values()), peak_paths)
    for rows in SHAPE_ROWS:
        ceiling.shape_gflops[rows] = projection_rate(shape, rows, td, budget / 3)
    return ceiling


@dataclass
class Ceilings:
    cpu: CpuInfo
    read_gbps: float
    dtypes: dict[str, DtypeCeiling]

    def to_json(self) -> dict:
        return asdict(self)


def measure(shape: ModelShape, dtypes: list[str], quick: bool = False) -> Ceilings:
    info = cpu_info()
    return Ceilings(
        info,
        read_bandwidth_gbps(256 if quick else 512),
        {d: measure_dtype(shape, d, quick) for d in dtypes},
    )


@dataclass(frozen=True)
class Workload:
    num_requests: int = 32
    prompt_len: int = 128
    output_len: int = 128


def compute_dtype(c: Ceilings, dtype: str) -> str:
    """The dtype whose GEMM rates bound `dtype`'s products. int8 weights keep float32 activations, but from
    native_quant.Q_BF16_MIN_ROWS rows (a batch-32 step, a prefill) the engine multiplies them as bf16 tiles where
    the CPU has AVX-512 BF16: there the bf16 ceiling is theirs. (Against float32's, W int8 read 110% of its
    ceiling on Zen 4, 2026-12-07.)"""
    if dtype == "int8":
        return "bfloat16" if "avx512_bf16" in c.cpu.flags and "bfloat16" in c.dtypes else "float32"
    return dtype if dtype in c.dtypes else "float32"


def floors(shape: ModelShape, c: Ceilings, dtype: str, w: Workload = Workload()) -> dict[str, float]:
    """The floors/ceilings an engine figure at `dtype` is compared with. Weights read at `dtype` (int8 counts
    as its own dtype for bytes); products at compute_dtype's rates."""
    compute = c.dtypes[compute_dtype(c, dtype)]
    prefill, decode = shape.workload_flops(w.num_requests, w.prompt_len, w.output_len)
    out_tokens = w.num_requests * w.output_len
    by_shape = prefill / (compute.shape_gflops[2048] * 1e9) + decode / (compute.shape_gflops[32] * 1e9)
    peak, bandwidth = compute.peak_gflops * 1e9, c.read_gbps * 1e9
    decode_steps_s = sum(
        max(
            w.num_requests * shape.decode_flops(ctx) / peak,
            (shape.weight_bytes(dtype) + w.num_requests * shape.kv_bytes(ctx, dtype)) / bandwidth,
        )
        for ctx in range(w.prompt_len + 1, w.prompt_len + w.output_len)
    )
    return {
        "w_tok_s_ceiling": out_tokens / ((prefill + decode) / peak),
        "w_tok_s_ceiling_at_shapes": out_tokens / by_shape,
        "w_tok_s_roofline": out_tokens / (prefill / peak + decode_steps_s),
        "decode_b1_floor_ms": 1e3 * shape.weight_bytes(dtype) / (c.read_gbps * 1e9),
        "ttft_floor_s": shape.prefill_flops(w.prompt_len) / (compute.peak_gflops * 1e9),
    }


def shares(
    shape: ModelShape, c: Ceilings, dtype: str, w_tok_s=None, b1_ms=None, ttft_s=None, b1_runs=()
) -> list[str]:
    """Each measured engine figure next to its ceiling, as lines to print. b1_runs: B1Run per batch-1 run: a shared
    host's bandwidth moved between 26 and 65 GB/s within an hour (2026-12-04), so each run is also put against the
    floor of its own moment."""
    f = floors(shape, c, dtype)
    lines = []
    if w_tok_s:
        lines.append(
            f"W {dtype}: {w_tok_s:.1f} tok/s = {w_tok_s / f['w_tok_s_ceiling']:.0%} of the compute ceiling "
            f"{f['w_tok_s_ceiling']:.0f} tok/s at the GEMM peak ({w_tok_s / f['w_tok_s_ceiling_at_shapes']:.0%} "
            f"of {f['w_tok_s_ceiling_at_shapes']:.0f} at the measured 2048/32-row rates; "
            f"{w_tok_s / f['w_tok_s_roofline']:.0%} of the roofline {f['w_tok_s_roofline']:.0f}, decode steps "
            f"bound by the larger of compute and weight + K/V bytes at {c.read_gbps:.1f} GB/s)"
        )
    if b1_ms:
        lines.append(
            f"batch-1 decode {dtype}: {b1_ms:.1f} ms/token = {b1_ms / f['decode_b1_floor_ms']:.2f}x the "
            f"bandwidth floor {f['decode_b1_floor_ms']:.1f} ms ({shape.weight_bytes(dtype) / 1e6:.0f} MB of "
            f"weights at {c.read_gbps:.1f} GB/s)"
        )
    if b1_runs:
        lines.append(f"batch-1 decode {dtype}: {b1_runs_line(shape.weight_bytes(dtype), b1_runs)}")
    if ttft_s:
        lines.append(
            f"TTFT {dtype} (128-token prompt): {ttft_s * 1e3:.0f} ms = {ttft_s / f['ttft_floor_s']:.2f}x the "
            f"prefill compute floor {f['ttft_floor_s'] * 1e3:.0f} ms"
        )
    return lines


BAND_HELD = 0.10  # probes around a run further apart than this: the host's bandwidth switched during it


@dataclass(frozen=True)
class B1Run:
    """One batch-1 run: its ms/token and the read bandwidth probed just before and just after it."""

    ms: float
    gbps_before: float
    gbps_after: float

    @property
    def band_held(self) -> bool:
        lo, hi = sorted((self.gbps_before, self.gbps_after))
        return hi - lo <= BAND_HELD * hi

    def floor_ratio(self, weight_bytes: int) -> float:
        """ms/token over the floor at the mean of the two probes (the bandwidth the run most likely had; the
        probe before alone put runs that met a switch into the wrong band: 2026-12-07)."""
        gbps = (self.gbps_before + self.gbps_after) / 2
        return self.ms / (weight_bytes / (gbps * 1e9) * 1e3)


def b1_runs_line(weight_bytes: int, runs: list[B1Run]) -> str:
    held = [r.floor_ratio(weight_bytes) for r in runs if r.band_held]
    each = ", ".join(f"{r.ms:.1f} ms at {r.gbps_before:.0f}->{r.gbps_after:.0f} GB/s" for r in runs)
    steady = f"{len(held)} whose band held: median {statistics.median(held):.2f}x" if held else "no band held"
    return (
        f"median {statistics.median(r.floor_ratio(weight_bytes) for r in runs):.2f}x the floor at the bandwidth "
        f"probed around each run ({len(runs)} runs; {steady}): {each}"
    )


def report(shape: ModelShape, c: Ceilings) -> list[str]:
    lines = [c.cpu.line(), f"memory read bandwidth: {c.read_gbps:.1f} GB/s"]
    for d in c.dtypes.values():
        paths = ", ".join(f"{k} {v:.0f}" for k, v in d.peak_paths.items())
        rows = ", ".join(f"{r} rows {g:.0f}" for r, g in d.shape_gflops.items())
        native = (
            ""
            if native_dtype(d.dtype, c.cpu.flags)
            else " (no bf16 units on this CPU: the native kernel widens to float32)"
            if "native" in d.peak_paths
            else " (no native support on this CPU: emulated)"
        )
        lines.append(
            f"GEMM {d.dtype}{native}: peak {d.peak_gflops:.0f} GFLOP/s at {PEAK_ROWS}x{shape.hidden}x"
            f"{shape.intermediate} ({paths}); model projections + head: {rows}"
        )
    for dtype in [*c.dtypes, "int8"]:
        f = floors(shape, c, dtype)
        lines.append(
            f"floors {dtype}: W <= {f['w_tok_s_ceiling']:.0f} tok/s ({f['w_tok_s_ceiling_at_shapes']:.0f} at "
            f"measured shapes, {f['w_tok_s_roofline']:.0f} with bandwidth-bound decode), batch-1 decode >= "
            f"{f['decode_b1_floor_ms']:.1f} ms/token, TTFT(128) >= {f['ttft_floor_s'] * 1e3:.0f} ms"
        )
    return lines


def smollm2_shape() -> ModelShape:
    """SmolLM2-135M, the benchmarks' model (its config, without loading anything)."""
    return ModelShape(
        num_layers=30,
        hidden=576,
        intermediate=1536,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        vocab=49152,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default=None, help="default: float32, plus bfloat16 where the CPU has it")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("LLMDEPLOY_THREADS", os.cpu_count() or 1)))
    shape = smollm2_shape()
    dtypes = args.dtypes.split(",") if args.dtypes else default_dtypes()
    c = measure(shape, dtypes, args.quick)
    for line in report(shape, c):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(c.to_json(), indent=1))


def default_dtypes() -> list[str]:
    flags = tuple(f for f in RELEVANT_FLAGS if f in cpu_flags())
    return ["float32"] + (["bfloat16"] if native_dtype("bfloat16", flags) else [])


if __name__ == "__main__":
    main()
