"""Decode at small batches (2-16 concurrent requests, what a 2-core CPU engine serves most of the time): the engine's
decode step at each batch size with the AVX2 float32 linear's side-by-side walk (LLMDEPLOY_SIDE_ROWS, the default)
and with every row count walking one weight tile at a time, alternating in one process, against the step's roofline
floor measured in the same run.

    python bench/small_batches.py [--batches 1,2,3,4,6,8,12,16] [--steps 24] [--passes 2] [--prompt-len 128]
                                  [--dtype float32|bfloat16]

Each cell: the median of --steps decode-only steps after the batch's prefills (greedy, EOS ignored); the best of
--passes passes. Floor: max(the step's FLOPs at the measured GEMM peak, its weight + K/V bytes at the measured read
bandwidth). On CPUs where the AVX-512 float32 linear runs, the setting changes nothing and both columns time the
same walk.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import ceilings  # noqa: E402
from llmdeploy.engine import LLM, SamplingParams  # noqa: E402
from llmdeploy.kernels import native_build  # noqa: E402

MODEL = "builtin:smollm2-135m-instruct"


def start_decoding(llm: LLM, batch: int, params: SamplingParams, prompt_len: int, salt: int) -> None:
    """`batch` fresh requests (new prompts: no prefix-cache help) through their prefills and first decode step."""
    engine = llm.engine
    vocab = engine.arch.vocab_size
    for i in range(batch):
        ids = [(salt * 7919 + 7 * i + 13 * j) % (vocab - 10) + 5 for j in range(prompt_len)]
        engine.add_request(f"b{batch}-{salt}-{i}", ids, params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()


def decode_step_ms(llm: LLM, batch: int, prompt_len: int, steps: int, salt: int) -> tuple[float, float]:
    """Median ms of `steps` decode-only steps of `batch` fresh requests (new prompts: no prefix-cache help), each
    over the tokens a sequence got from it (a decode burst makes several), and the mean context they ran at."""
    engine = llm.engine
    # room for the prefill's token and a whole burst every decode step, so no timed step finds its requests done
    params = SamplingParams(
        temperature=0, max_tokens=(steps + 1) * engine.config.decode_burst + 2, ignore_eos=True
    )
    start_decoding(llm, batch, params, prompt_len, salt)
    times, contexts = [], []
    for _ in range(steps):
        contexts.extend(len(s) for s in engine.scheduler.running)
        t, made = time.perf_counter(), engine.counters["generation"]
        engine.step()
        made = engine.counters["generation"] - made
        assert made > 0, "a timed step made no token"
        times.append((time.perf_counter() - t) * batch / made)
    contexts.extend(len(s) for s in engine.scheduler.running)
    while engine.has_unfinished():
        engine.step()
    return 1e3 * statistics.median(times), statistics.mean(contexts)


def floor_ms(shape: ceilings.ModelShape, c: ceilings.Ceilings, dtype: str, batch: int, context: int) -> float:
    peak, bandwidth = c.dtypes[dtype].peak_gflops * 1e9, c.read_gbps * 1e9
    compute = batch * shape.decode_flops(context) / peak
    memory = (shape.weight_bytes(dtype) + batch * shape.kv_bytes(context, dtype)) / bandwidth
    return 1e3 * max(compute, memory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    print(ceilings.cpu_info().line())
    dtype = args.dtype
    llm = LLM(model=MODEL, dtype=dtype, max_num_seqs=64)
    shape = ceilings.smollm2_shape()
    c = ceilings.measure(shape, [dtype], quick=True)
    lib = native_build.library()
    side_default = native_build.env_rows(native_build.SIDE_ROWS_ENV, native_build.SIDE_ROWS_DEFAULT)
    print(
        f"read bandwidth {c.read_gbps:.1f} GB/s, {dtype} GEMM peak {c.dtypes[dtype].peak_gflops:.0f} GFLOP/s"
    )
    print(
        f"side-by-side walk up to {side_default} rows (LLMDEPLOY_SIDE_ROWS); decode step ms, best of {args.passes}"
    )
    print(
        f"{'batch':>5} {'side by side':>13} {'one tile':>9} {'ratio':>6} {'floor':>6} {'x floor':>8} {'tok/s':>7}"
    )
    salt = 0
    for batch in [int(b) for b in args.batches.split(",")]:
        side, one, contexts = [], [], []
        for _ in range(args.passes):
            for rows, out in ((side_default, side), (0, one)):
                if lib is not None:
                    lib.llmd_side_rows_configure(rows)
                salt += 1
                ms, context = decode_step_ms(llm, batch, args.prompt_len, args.steps, salt)
                out.append(ms)
                contexts.append(context)
        if lib is not None:
            lib.llmd_side_rows_configure(side_default)
        s, o = min(side), min(one)
        f = floor_ms(shape, c, dtype, batch, round(statistics.mean(contexts)))
        print(
            f"{batch:5d} {s:13.2f} {o:9.2f} {s / o:6.2f} {f:6.2f} {s / f:8.2f} {1e3 * batch / s:7.0f}",
            flush=True,
        )
    print(ceilings.cpu_info().line())


if __name__ == "__main__":
    main()
