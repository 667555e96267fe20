"""engine.compile on CPU: what torch.compile of the decoder layers costs at start and gains per step (issue 13).

    python bench/compile_start.py [--model builtin:smollm2-135m-instruct] [--dtype float32] [--rounds 2]

Each variant starts a fresh process: eager (engine.compile false), compiled with an empty inductor cache (the
first start ever), and compiled again on the cache the previous start left (a restart). Each reports the engine
start (LLM(...): load, pack, warm-up steps, which is where the compile happens), then batch-1 decode ms/token and
batch-32 decode ms/step (median over steps of a 32 x 64-token generation). Variants alternate --rounds times
so that a busy machine slows them alike; medians of the rounds are printed with the CPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ceilings import cpu_info  # noqa: E402

CHILD = r"""
import json, statistics, sys, time
sys.path.insert(0, {root!r})
import torch
from llmdeploy.engine import LLM, SamplingParams
t0 = time.perf_counter()
llm = LLM(model={model!r}, dtype={dtype!r}, compile={compile}, max_num_seqs=64, decode_burst=1)  # step by step
start_s = time.perf_counter() - t0
engine = llm.engine
engine.stream = True

def decode_times(batch, tokens):
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{{batch}}-{{i}}", [(11 * i + 7 * j) % 4000 + 5 for j in range(64)], params)
    stamps = []
    while engine.has_unfinished():
        engine.step()
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(gaps[len(gaps) // 4:])  # decode steps: past the prefills

b1 = decode_times(1, 48)
b32 = decode_times(32, 48)
print("RESULT " + json.dumps({{"start_s": start_s, "decode_b1_ms": 1e3 * b1, "decode_b32_ms": 1e3 * b32}}))
"""


def run_child(model: str, dtype: str, compile_: bool, inductor_dir: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir)
    env.pop("LLMDEPLOY_COMPILE", None)
    code = CHILD.format(root=str(ROOT), model=model, dtype=dtype, compile=compile_)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"child failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    print(cpu_info().line(), flush=True)
    results: dict[str, list[dict]] = {"eager": [], "compiled, empty cache": [], "compiled, warm cache": []}
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            for name, compile_ in (
                ("eager", False),
                ("compiled, empty cache", True),
                ("compiled, warm cache", True),
            ):
                res = run_child(args.model, args.dtype, compile_, cache)
                results[name].append(res)
                print(
                    f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True
                )
    print(f"medians of {args.rounds} rounds ({args.dtype}):")
    summary = {}
    for name, rows in results.items():
        summary[name] = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        print(f"  {name:22s} " + ", ".join(f"{k} {v:.2f}" for k, v in summary[name].items()))
    print(cpu_info().line())
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "medians": summary}, indent=1))


if __name__ == "__main__":
    main()
