"""First and second start of a model through load_model, each in a fresh process (as an engine start is).

    python bench/load_times.py [--model builtin:smollm2-135m-instruct] [--reps 3] [--json out.json]

The first start runs with an empty LLMDEPLOY_CACHE_DIR (GGUF -> dequantized safetensors conversion); the
second and later starts read the cached copy. Reported: load_model() wall time inside the process, and the
whole process (interpreter start and imports included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(2)
from llmdeploy.engine.loader import load_model
t1 = time.perf_counter()
lm = load_model(sys.argv[1], dtype=sys.argv[2])
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_model_s": t2 - t1, "dtype": str(lm.dtype)}))
"""


def start(model: str, dtype: str, cache_dir: str) -> dict:
    env = {**os.environ, "LLMDEPLOY_CACHE_DIR": cache_dir, "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model, dtype], env=env, capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"first": [], "second": []}
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as cache_dir:
            runs["first"].append(start(args.model, args.dtype, cache_dir))
            runs["second"].append(start(args.model, args.dtype, cache_dir))
    summary = {
        kind: {k: statistics.median(r[k] for r in rs) for k in ("load_model_s", "process_s")}
        for kind, rs in runs.items()
    }
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": args.model,
        "load_avg": os.getloadavg(),
        "median": summary,
        "runs": runs,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
