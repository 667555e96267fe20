"""The native paged decode attention alone (kernels/csrc/decode_attention.c), SmolLM2's heads (9 query, 3 kv, head
dim 64), blocks of 16 tokens laid out in random order as a batch that grew together leaves them:

    python bench/decode_attention.py [--dtypes float32,bfloat16] [--cases 1x430,4x300,32x192,32x512]
                                     [--baseline OLD.c] [--reps 7]

Each case times one call a layer over 30 layers' caches behind a weight stream (a layer's share of SmolLM2's bf16
weights, 9 MB, read before each call, untimed: the engine's situation, K/V and the kernel's own data evicted from
every cache level), over the same caches back to back (cold: K/V from memory where 30 layers' caches exceed the
last-level cache; on memory advised for huge pages, as the engine's cache) and over one layer's cache 30 times
(L3-resident), and prints microseconds a layer and the K/V read rate beside the machine's read bandwidth.
--baseline compiles another version of the kernel file (e.g. `git show HEAD~1:llmdeploy/kernels/csrc/
decode_attention.c > /tmp/old.c`) and times it on the same caches, alternating, so the ratio comes from one run; it
also says whether both give the same bits.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ceilings import cpu_info, read_bandwidth_gbps  # noqa: E402
from llmdeploy.kernels import native_build  # noqa: E402
from llmdeploy.kernels.huge_pages import huge_empty  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
WEIGHTS_PER_LAYER = 269_000_000 // LAYERS  # bytes of SmolLM2's bf16 weights a layer streams


def compiled(source: Path, out_dir: Path, flags: tuple[str, ...] = native_build.FLAGS):
    """`source` (a decode_attention.c) built with the current AVX-512 passes it may call, as native_build builds the
    library (the tests pass a quicker -O1: same results, a third of the compile time)"""
    out = out_dir / f"{source.stem}.so"
    cc, csrc = native_build.compiler(), native_build.CSRC
    sources = [str(source), str(csrc / "decode_attention_avx512.c")]
    subprocess.run([cc, *flags, f"-I{csrc}", *sources, "-o", str(out)], check=True)
    fn = ctypes.CDLL(str(out)).llmd_paged_decode_attention
    fn.argtypes, fn.restype = native_build.SIGNATURES["llmd_paged_decode_attention"], ctypes.c_int
    return fn


def current():
    lib = native_build.library()
    if lib is None:
        raise SystemExit("the native CPU kernels are not available here")
    return lib.llmd_paged_decode_attention


def cache(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """random K or V on memory advised for huge pages, as the engine's cache (model_runner: huge_zeros)"""
    out = huge_empty(math.prod(shape), dtype).view(shape)
    return out.copy_(torch.randn(shape))


class Case:
    """caches, block tables and a query for `batch` sequences of `context` tokens"""

    def __init__(
        self, dtype: torch.dtype, batch: int, context: int, layers: int, distinct: bool = True
    ) -> None:
        """`layers` caches, or (distinct False) one cache called `layers` times, so every mode times calls back to
        back (a lone call a run also timed the threads' wake-up: 12.1 us against 9.3 at 1 x 160, 2026-12-07)."""
        self.dtype, self.batch, self.context = dtype, batch, context
        per = -(-context // BLOCK)
        blocks = batch * per + 1
        shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
        pairs = [(cache(shape, dtype), cache(shape, dtype)) for _ in range(layers if distinct else 1)]
        self.caches = pairs if distinct else pairs * layers
        self.tables = (
            (torch.randperm(blocks - 1)[: batch * per].view(batch, per) + 1).to(torch.int32).contiguous()
        )
        self.lens = torch.full((batch,), context, dtype=torch.int32)
        # a bf16 model's queries are bf16 values (the bf16 passes take only those)
        self.q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype).float()
        self.out = torch.empty(batch, HEADS, HEAD_DIM)

    def run(self, fn, flush: torch.Tensor | None = None) -> float:
        """one call a layer; seconds in the calls. With `flush` ([layers, n] float32), its row for a layer is read
        before that layer's call (not timed), as the engine streams a layer's weights between two attentions."""
        bf16, total = int(self.dtype == torch.bfloat16), 0.0
        for i, (k, v) in enumerate(self.caches):
            if flush is not None:
                flush[i % flush.shape[0]].sum()
            t = time.perf_counter()
            rc = fn(
                self.q.data_ptr(),
                HEADS * HEAD_DIM,
                k.data_ptr(),
                v.data_ptr(),
                bf16,
                self.tables.data_ptr(),
                self.tables.shape[1],
                self.lens.data_ptr(),
                self.out.data_ptr(),
                self.batch,
                HEADS,
                KV_HEADS,
                HEAD_DIM,
                BLOCK,
                HEAD_DIM**-0.5,
                torch.get_num_threads(),
            )
            total += time.perf_counter() - t
            if rc != 0:
                raise RuntimeError(f"decode attention returned {rc}")
        return total

    def kv_bytes(self) -> int:
        return 2 * self.batch * self.context * KV_HEADS * HEAD_DIM * self.caches[0][0].element_size()


def time_case(
    case: Case, fns: list, reps: int, flush: torch.Tensor | None = None
) -> tuple[list[float], bool]:
    """min seconds a layer of each kernel (alternating), and whether all gave the same bits"""
    outs = []
    for fn in fns:
        case.run(fn, flush)
        outs.append(case.out.clone())
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], case.run(fn, flush) / len(case.caches))
    return best, all(torch.equal(outs[0], o) for o in outs[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--cases", default="1x430,4x300,32x192,32x512", help="BATCHxCONTEXT, comma-separated")
    ap.add_argument("--baseline", type=Path, help="another decode_attention.c to time alongside")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    print(cpu_info().line())
    print(f"memory read bandwidth: {read_bandwidth_gbps():.1f} GB/s; {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        fns = [compiled(args.baseline, Path(tmp)), current()] if args.baseline else [current()]
        head = (
            "baseline us (GB/s)    this us (GB/s)   ratio  same bits"
            if args.baseline
            else "us a layer (GB/s)"
        )
        # a layer's share of SmolLM2's bf16 weights (269 MB / 30), read before each call: what the engine does
        flush = torch.ones(LAYERS, WEIGHTS_PER_LAYER // 4)
        modes = (
            ("behind a weight stream", flush, True),
            ("cold", None, True),
            ("L3-resident", None, False),
        )
        for label, between, distinct in modes:
            over = f"{LAYERS} layers' caches" if distinct else "one layer's cache"
            print(f"\n{label}: {LAYERS} calls back to back over {over}")
            print(f"{'dtype':9s} {'batch':>5s} {'context':>7s}  {head}")
            for dtype in args.dtypes.split(","):
                for spec in args.cases.split(","):
                    batch, context = (int(x) for x in spec.split("x"))
                    case = Case(getattr(torch, dtype), batch, context, LAYERS, distinct)
                    best, same = time_case(case, fns, args.reps, between)
                    cells = "  ".join(f"{1e6 * s:8.1f} ({case.kv_bytes() / s / 1e9:5.1f})" for s in best)
                    extra = f"  {best[-1] / best[0]:5.2f}  {same}" if args.baseline else ""
                    print(f"{dtype:9s} {batch:5d} {context:7d}  {cells}{extra}")
    print(cpu_info().line())


if __name__ == "__main__":
    main()
