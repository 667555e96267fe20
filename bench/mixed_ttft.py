"""Mixed-load TTFT: do long prompts starve short ones? (issue 3, performance)

    python bench/mixed_ttft.py [--dtype auto] [--max-num-batched-tokens 2048] [--interval 0.5] [--json out.json]

32 requests arrive one every --interval seconds; 4 of them (positions 2, 9, 16, 23) have 1,500-token prompts,
the other 28 have 128-token prompts; every request generates 32 tokens (greedy, EOS ignored). At 0.5 s the
engine is busy but not overloaded (~600 prompt tokens/s arrive); much faster arrivals only measure queueing.
Reported: the short requests' TTFT p50/p99 against a short request's TTFT alone on the idle engine (median of 5).
Target: p99 < 3x.
TTFT = first token time - arrival time, from the engine's per-request metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_vs_hf import MODEL, WORDS  # noqa: E402
from llmdeploy.engine import AsyncLLMEngine, EngineConfig, SamplingParams  # noqa: E402

N, LONG_AT, SHORT_LEN, LONG_LEN, OUT_LEN = 32, (2, 9, 16, 23), 128, 1500, 32


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


async def ttft_of(engine: AsyncLLMEngine, ids: list[int], rid: str) -> float:
    params = SamplingParams(temperature=0, max_tokens=OUT_LEN, ignore_eos=True)
    async for out in engine.generate(ids, params, rid):
        last = out
    m = last.metrics
    return m.first_token_time - m.arrival_time


async def run(args) -> dict:
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
    alone = [await ttft_of(engine, prompt(tok, 900 + i, SHORT_LEN), f"alone-{i}") for i in range(5)]
    prompts = [prompt(tok, i, LONG_LEN if i in LONG_AT else SHORT_LEN) for i in range(N)]
    preempt0 = engine.stats().num_preemptions

    async def arrive(i: int) -> float:
        await asyncio.sleep(i * args.interval)
        return await ttft_of(engine, prompts[i], f"mixed-{i}")

    t0 = time.perf_counter()
    ttfts = await asyncio.gather(*(arrive(i) for i in range(N)))
    wall = time.perf_counter() - t0
    await engine.shutdown()
    short = [t for i, t in enumerate(ttfts) if i not in LONG_AT]
    alone_s = statistics.median(alone)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "interval_s": args.interval,
        "short_alone_ttft_s": alone_s,
        "short_ttft_p50_s": percentile(short, 0.5),
        "short_ttft_p99_s": percentile(short, 0.99),
        "short_ttft_max_s": max(short),
        "p99_over_alone": percentile(short, 0.99) / alone_s,
        "long_ttft_s": [round(ttfts[i], 3) for i in LONG_AT],
        "wall_s": wall,
        "preemptions": engine.stats().num_preemptions - preempt0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)  # the engine's default
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = asyncio.run(run(args))
    for k, v in res.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    print(f"short p99 TTFT = {res['p99_over_alone']:.2f} x alone (target < 3)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
