"""Mixed-load TTFT: are short and long prompts both served within a bound? (issues 3 and 19, performance)

    python bench/mixed_ttft.py [--dtype auto] [--max-num-batched-tokens 2048] [--interval 0.5] [--json out.json]

32 requests arrive one every --interval seconds; 4 of them (positions 2, 9, 16, 23) have 1,500-token prompts,
the other 28 have 128-token prompts; every request generates 32 tokens (greedy, EOS ignored). At 0.5 s the
engine is busy but not overloaded on the 2-core CPU (~600 prompt tokens/s arrive). The run is repeated at half and
at twice the interval (--intervals to choose others), on one engine, in one process.

Reported per interval: the short requests' TTFT p50/p99 against a short request's TTFT alone on the idle engine
(median of 5), and the long requests' TTFTs and p99 against a long request's TTFT alone (median of 3).
Targets (issue 19), at the default interval: short p99 <= 2.5x alone and long p99 <= 3x alone.
TTFT = first token time - arrival time, from the engine's per-request metrics. Printed with the CPU model and the
load average before and after: on a shared machine the load moves every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.engine_vs_hf import MODEL, WORDS  # noqa: E402
from llmdeploy.engine import AsyncLLMEngine, EngineConfig, SamplingParams  # noqa: E402

N, LONG_AT, SHORT_LEN, LONG_LEN, OUT_LEN = 32, (2, 9, 16, 23), 128, 1500, 32
SHORT_TARGET, LONG_TARGET = 2.5, 3.0


def prompt(tokenizer, i: int, length: int) -> list[int]:
    r = random.Random(5000 + i)
    text = f"Request {i}. Summarize: " + " ".join(r.choice(WORDS) for _ in range(length * 2))
    ids = tokenizer.encode(text)[:length]
    assert len(ids) == length
    return ids


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        return next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")
        )
    except (OSError, StopIteration, subprocess.SubprocessError):
        return platform.processor() or "unknown"


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


async def ttft_of(engine: AsyncLLMEngine, ids: list[int], rid: str) -> float:
    params = SamplingParams(temperature=0, max_tokens=OUT_LEN, ignore_eos=True)
    async for out in engine.generate(ids, params, rid):
        last = out
    m = last.metrics
    return m.first_token_time - m.arrival_time


async def mixed_run(
    engine: AsyncLLMEngine, interval: float, alone_short: float, alone_long: float, run_no: int
) -> dict:
    tok = engine.tokenizer
    tag = f"{interval:g}"
    # fresh prompts in every run: the same engine's prefix cache would otherwise serve a repeated one at once
    prompts = [prompt(tok, 1000 * run_no + i, LONG_LEN if i in LONG_AT else SHORT_LEN) for i in range(N)]
    preempt0 = engine.stats().num_preemptions

    async def arrive(i: int) -> float:
        await asyncio.sleep(i * interval)
        return await ttft_of(engine, prompts[i], f"mixed-{tag}-{i}")

    t0 = time.perf_counter()
    ttfts = await asyncio.gather(*(arrive(i) for i in range(N)))
    wall = time.perf_counter() - t0
    short = [t for i, t in enumerate(ttfts) if i not in LONG_AT]
    long = [ttfts[i] for i in LONG_AT]
    return {
        "interval_s": interval,
        "short_ttft_p50_s": percentile(short, 0.5),
        "short_ttft_p99_s": percentile(short, 0.99),
        "short_ttft_max_s": max(short),
        "short_p99_over_alone": percentile(short, 0.99) / alone_short,
        "long_ttft_s": [round(t, 3) for t in long],
        "long_ttft_p99_s": percentile(long, 0.99),
        "long_p99_over_alone": percentile(long, 0.99) / alone_long,
        "wall_s": wall,
        "preemptions": engine.stats().num_preemptions - preempt0,
    }


async def run(args) -> dict:
    load_before = load_average()
    engine = AsyncLLMEngine(
        EngineConfig(
            model=MODEL,
            dtype=args.dtype,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=64,
            max_model_len=2048,
        )
    )
    await engine.start()
    tok = engine.tokenizer
    await ttft_of(engine, prompt(tok, 999, SHORT_LEN), "warmup")
    alone_short = [await ttft_of(engine, prompt(tok, 900 + i, SHORT_LEN), f"alone-{i}") for i in range(5)]
    alone_long = [await ttft_of(engine, prompt(tok, 950 + i, LONG_LEN), f"alone-long-{i}") for i in range(3)]
    a_short, a_long = statistics.median(alone_short), statistics.median(alone_long)
    if (
        args.interval_in_alone
    ):  # the same load relative to this machine's speed (the idle 2-core AMD: 0.5 s = 5x)
        args.interval = round(args.interval_in_alone * a_short, 3)
    intervals = args.intervals or [args.interval / 2, args.interval, args.interval * 2]
    if args.only_default:
        intervals = [args.interval]
    print(f"alone: short {a_short:.3f} s, long {a_long:.3f} s (load {load_average()})", file=sys.stderr)
    runs = []
    for run_no, iv in enumerate(intervals):
        runs.append(await mixed_run(engine, iv, a_short, a_long, run_no))
        r = runs[-1]
        print(
            f"interval {iv:g} s: short p99 {r['short_p99_over_alone']:.2f}x, long p99 {r['long_p99_over_alone']:.2f}x"
            f" alone, {r['wall_s']:.0f} s (load {load_average()})",
            file=sys.stderr,
        )
    await engine.shutdown()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_model(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "torch_threads": torch.get_num_threads(),
        "default_interval_s": args.interval,
        "short_alone_ttft_s": a_short,
        "short_alone_runs_s": [round(t, 3) for t in alone_short],
        "long_alone_ttft_s": a_long,
        "long_alone_runs_s": [round(t, 3) for t in alone_long],
        "runs": runs,
    }


def table(res: dict, default_interval: float) -> str:
    head = (
        "| interval (s) | short p50 (s) | short p99 (s) | short p99 / alone | long TTFTs (s) | long p99 / alone "
        "| wall (s) | preemptions | targets met |\n|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    for r in res["runs"]:
        met = r["short_p99_over_alone"] <= SHORT_TARGET and r["long_p99_over_alone"] <= LONG_TARGET
        verdict = (
            ("yes" if met else "no") if r["interval_s"] == default_interval else ("(yes)" if met else "(no)")
        )
        longs = ", ".join(f"{t:.2f}" for t in r["long_ttft_s"])
        rows.append(
            f"| {r['interval_s']:g} | {r['short_ttft_p50_s']:.3f} | {r['short_ttft_p99_s']:.3f} "
            f"| {r['short_p99_over_alone']:.2f}x | {longs} | {r['long_p99_over_alone']:.2f}x | {r['wall_s']:.1f} "
            f"| {r['preemptions']} | {verdict} |"
        )
    return "\n".join([head, *rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)  # the engine's default
    ap.add_argument("--interval", type=float, default=0.5, help="the default interval (runs at /2, x1, x2)")
    ap.add_argument("--intervals", type=float, nargs="+", default=None, help="run exactly these intervals")
    ap.add_argument(
        "--interval-in-alone",
        type=float,
        default=None,
        metavar="K",
        help="default interval = K x a short request's TTFT alone (K=5 is 0.5 s on the idle 2-core AMD): "
        "a slower or busier machine then gets the same relative load",
    )
    ap.add_argument("--only-default", action="store_true", help="run the default interval only (quicker)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = asyncio.run(run(args))
    print(
        f"date: {res['date']}   CPU: {res['cpu']}   load average before/after: {res['load_average_before']}"
        f" / {res['load_average_after']}"
    )
    print(
        f"dtype {res['dtype']}, max_num_batched_tokens {res['max_num_batched_tokens']}, "
        f"torch threads {res['torch_threads']}"
    )
    print(
        f"short ({SHORT_LEN} tokens) TTFT alone: {res['short_alone_ttft_s']:.3f} s {res['short_alone_runs_s']}"
    )
    print(f"long ({LONG_LEN} tokens) TTFT alone: {res['long_alone_ttft_s']:.3f} s {res['long_alone_runs_s']}")
    iv = res["default_interval_s"]
    print(
        f"targets at interval {iv:g} s: short p99 <= {SHORT_TARGET}x alone, long p99 <= {LONG_TARGET}x alone"
    )
    print(table(res, iv))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
