"""Where the native linear kernels stop paying: SmolLM2-135M's projections through the native kernel and through
oneDNN (AMX where the CPU has it), at each row count, as the decode and prefill steps run them.

    python bench/linear_rows.py [--dtypes bfloat16,float32] [--rows 1,2,4,...] [--reps 7] [--json out.json]

One timing = the 4 projections (qkv, o, gate_up, down) of all 30 layers plus the LM head at `rows` rows, on 30
separate weights per shape, so weights stream from memory as they do in a step. Min of --reps after a warm-up.
float32 up to 64 rows: also timed with the next-tile prefetch off (TILE_AHEAD_ROWS_DEFAULT's evidence on each CPU); both
dtypes at one row reading one weight tile at a time instead of row_streams() side by side, and so the AVX2
kernels (float32, and bf16 on CPUs without AVX-512 BF16) up to SIDE_ROWS_DEFAULT rows (their small-batch walk;
SIDE_ROWS_DEFAULT's evidence). oneDNN's column is '-' where it cannot pack the dtype (bf16 on AVX2-only CPUs).
Where the CPU has AMX, the native kernel is also timed on its AMX tiles (kernels/csrc/amx_linear.c); the table
decides `AMX_MIN_ROWS_DEFAULT` (kernels/cpu_native.py), the row count from which bf16 linears take them. Prints the CPU and its flags first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ceilings import cpu_info  # noqa: E402
from llmdeploy.kernels import cpu_native, native_build  # noqa: E402

HIDDEN, INTER, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # [out, in] per layer
DEFAULT_ROWS = "1,2,4,8,12,16,20,24,32,48,64,128,256"


def weights(dtype: torch.dtype) -> list[tuple[torch.Tensor, int]]:
    torch.manual_seed(0)
    ws = [(torch.randn(n, k) * 0.02).to(dtype) for _ in range(LAYERS) for n, k in SHAPES]
    ws.append((torch.randn(VOCAB, HIDDEN) * 0.02).to(dtype))
    return [(w, w.shape[0]) for w in ws]


def onednn_pass(ws):
    """None where oneDNN cannot pack the dtype here (bf16 on an AVX2-only CPU)."""
    from llmdeploy.engine.models.layers import onednn_linear_available

    if not onednn_linear_available(ws[0][0].dtype):
        return None
    packed = [(torch.ops.mkldnn._reorder_linear_weight(w), n, w.shape[1]) for w, n in ws]

    def run(rows: int) -> None:
        for p, _n, k in packed:
            x = xs[(rows, k)]
            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    return run


def native_pass(ws):
    packed = [(cpu_native.native_pack(w), n, w.shape[1]) for w, n in ws]
    if any(p is None for p, _, _ in packed):
        return None

    def run(rows: int) -> None:
        for p, n, k in packed:
            cpu_native.native_linear(xs[(rows, k)], p, None, n)

    return run


xs: dict[tuple[int, int], torch.Tensor] = {}


def amx_on(min_rows: int) -> bool:
    """The native bf16 linear on AMX from min_rows rows (0: vdpbf16ps only); False where AMX cannot run."""
    lib = native_build.library()
    return lib is not None and lib.llmd_amx_configure(min_rows) > 0


def tile_ahead(rows: int) -> None:
    """float32 linears prefetch the next weight tile up to `rows` rows (0: never); LLMDEPLOY_TILE_AHEAD_ROWS at load."""
    lib = native_build.library()
    if lib is not None:
        lib.llmd_tile_ahead_configure(rows)


def row_streams(streams: int) -> None:
    """float32 and bf16 linears read `streams` weight tiles side by side at one row (1: a tile at a time);
    LLMDEPLOY_ROW_STREAMS at load."""
    lib = native_build.library()
    if lib is not None:
        lib.llmd_row_streams_configure(streams)


def side_rows(rows: int) -> None:
    """The AVX2 float32 linear reads tiles side by side up to `rows` rows (0: only one row); LLMDEPLOY_SIDE_ROWS at
    load."""
    lib = native_build.library()
    if lib is not None:
        lib.llmd_side_rows_configure(rows)


def one_tile_at_a_time(nat, rows: int, reps: int) -> float:
    """`nat` timed with every row count walking one weight tile at a time, the settings put back after."""
    row_streams(1)
    side_rows(0)
    try:
        return best_of(nat, rows, reps)
    finally:
        row_streams(native_build.row_streams(native_build.library()))
        side_rows(native_build.env_rows(native_build.SIDE_ROWS_ENV, native_build.SIDE_ROWS_DEFAULT))


def best_of(fn, rows: int, reps: int) -> float:
    fn(rows)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(rows)
        ts.append(time.perf_counter() - t)
    return min(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rows", default=DEFAULT_ROWS)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    info = cpu_info()
    print(info.line())
    rows_list = [int(r) for r in args.rows.split(",")]
    flops_per_row = 2 * (LAYERS * sum(n * k for n, k in SHAPES) + VOCAB * HIDDEN)
    out: dict[str, list[dict]] = {}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        ws = weights(dtype)
        for r in rows_list:
            for k in (HIDDEN, INTER):
                xs[(r, k)] = torch.randn(r, k).to(dtype)
        dnn, nat = onednn_pass(ws), native_pass(ws)
        amx = nat is not None and dtype == torch.bfloat16 and amx_on(1)
        amx_on(0)
        print(f"\n{name}: all projections of a step (30 layers + LM head), ms (GFLOP/s)")
        head = f"{'rows':>5} {'oneDNN':>16} {'native':>16} {'native/oneDNN':>14}"
        ahead = nat is not None and dtype == torch.float32
        # the AVX2 kernels' small-batch walk: float32 without AVX-512, bf16 without AVX-512 BF16
        lib = native_build.library()
        avx2_side = nat is not None and not (
            lib.llmd_has_avx512() if dtype == torch.float32 else lib.llmd_has_avx512_bf16()
        )
        print(
            head
            + (f" {'native AMX':>16} {'AMX/oneDNN':>11}" if amx else "")
            + (f" {'no next-tile prefetch':>22}" if ahead else "")
            + (f" {'one tile at a time':>19}" if nat is not None else "")
        )
        out[name] = []
        for r in rows_list:

            def cell(t: float | None, r: int = r) -> str:
                return f"{t * 1e3:8.2f} ({flops_per_row * r / t / 1e9:5.0f})" if t else f"{'-':>16}"

            d = best_of(dnn, r, args.reps) if dnn else None
            n = best_of(nat, r, args.reps) if nat else None
            line = f"{r:5d} {cell(d)} {cell(n)} " + (f"{n / d:14.2f}" if n and d else f"{'-':>14}")
            row = {"rows": r, "onednn_s": d, "native_s": n}
            if amx:
                amx_on(1)
                a = best_of(nat, r, args.reps)
                amx_on(0)
                line += f" {cell(a)} " + (f"{a / d:11.2f}" if d else f"{'-':>11}")
                row["native_amx_s"] = a
            if ahead and r <= native_build.TILE_AHEAD_ROWS_DEFAULT:
                tile_ahead(0)
                a = best_of(nat, r, args.reps)
                tile_ahead(
                    native_build.env_rows(native_build.AHEAD_ENV, native_build.TILE_AHEAD_ROWS_DEFAULT)
                )
                line += f" {cell(a)}"
                row["native_no_ahead_s"] = a
            if nat is not None and (r == 1 or (avx2_side and r <= native_build.SIDE_ROWS_DEFAULT)):
                a = one_tile_at_a_time(nat, r, args.reps)
                line += f" {cell(a):>19}"
                row["native_one_stream_s"] = a
            print(line)
            out[name].append(row)
        xs.clear()
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": dataclasses.asdict(info), "results": out}, indent=1))


if __name__ == "__main__":
    main()
