"""How long an engine process takes from its start to answering /health, first start against restart.

    python bench/engine_start.py [--model builtin:smollm2-135m-instruct] [--reps 3] [--json out.json]
    python bench/engine_start.py --against /tmp/base   # restarts against another checkout's code (git worktree)

A "first start" finds no start measures kept (engine/start_measures.py) and times the attention probe and the
step-cost calibration; a "restart" reads what the previous start kept. Both use the same converted GGUF and the
same native kernel build: this runs with a temporary LLMDEPLOY_CACHE_DIR whose kernels/ and gguf/ are links to the
real ones, so only the measures differ. Runs alternate (first, restart, first, ...). Phases come from the engine's
log lines: imports (up to the loader's dtype line), load (weights, packs), measures (probe and warm-up, the first
touch, up to the KV cache line), serve (the HTTP server up). Prints each phase's median and the CPU model.

--against DIR: restarts of this checkout's engine and of DIR's (its code first on PYTHONPATH), alternating, each
with its own measures and config kept by one start before.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from llmdeploy.engine.weights_cache import cache_root
from llmdeploy.kernels.cpu_flags import cpu_model
from llmdeploy.spec.addresses import free_port

MARKS = (  # phase -> the log line that ends it
    ("imports", "llmdeploy.engine.loader: dtype"),
    ("load", "weights loaded in"),
    ("measures", "KV cache:"),
    ("serve", "listening on"),
)
TIMEOUT_S = 300


def linked_cache(folder: Path) -> Path:
    """A cache root that shares the real one's kernel builds and GGUF conversions but not its measures."""
    real = cache_root()
    for part in ("kernels", "gguf"):
        (real / part).mkdir(parents=True, exist_ok=True)
        (folder / part).symlink_to(real / part)
    return folder


def start_once(model: str, env: dict[str, str]) -> dict[str, float]:
    """Seconds from the process's start to each mark and to the first /health 200."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "llmdeploy.engine",
        "--model",
        model,
        "--port",
        str(port),
        "--log-level",
        "info",
    ]
    t0 = time.perf_counter()
    # `python -m` puts its working directory first on sys.path: started from a checkout, the engine would run that
    # checkout's code whatever PYTHONPATH says
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=tempfile.gettempdir(),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    marks: dict[str, float] = {}

    def read_log() -> None:
        for line in proc.stderr:
            for phase, text in MARKS:
                if text in line and phase not in marks:
                    marks[phase] = time.perf_counter() - t0

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        while time.perf_counter() - t0 < TIMEOUT_S:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with {proc.returncode} before it was ready")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    marks["ready"] = time.perf_counter() - t0
                    return marks
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"engine not ready in {TIMEOUT_S} s")
    finally:
        proc.terminate()
        proc.wait(30)
        reader.join(5)


def phases(marks: dict[str, float]) -> dict[str, float]:
    """Each phase's seconds; a mark an older engine does not log is NaN and its time goes to the next phase."""
    out, before = {}, 0.0
    for phase, _ in MARKS:
        out[phase] = marks[phase] - before if phase in marks else math.nan
        before = marks.get(phase, before)
    out["ready"] = marks["ready"]
    return out


def engine_env(cache: Path, code: str | None = None) -> dict[str, str]:
    env = {**os.environ, "LLMDEPLOY_CACHE_DIR": str(linked_cache(cache)), "TOKENIZERS_PARALLELISM": "false"}
    if code is not None:
        env["PYTHONPATH"] = code
    return env


def first_and_restart(model: str, reps: int, tmp: Path) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {"first start": [], "restart": []}
    env = engine_env(tmp)
    for _ in range(reps):
        for kept in ("measures", "configs"):
            for f in (tmp / kept).glob("*.json"):
                f.unlink()
        runs["first start"].append(phases(start_once(model, env)))
        runs["restart"].append(phases(start_once(model, env)))
    return runs


def against(model: str, reps: int, tmp: Path, other: str) -> dict[str, list[dict[str, float]]]:
    for side in ("this", "other"):
        (tmp / side).mkdir()
    envs = {"this": engine_env(tmp / "this"), other: engine_env(tmp / "other", other)}
    for env in envs.values():
        start_once(model, env)  # keeps its measures and config
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in envs}
    for i in range(reps):
        for kind in list(envs)[:: 1 if i % 2 == 0 else -1]:
            runs[kind].append(phases(start_once(model, envs[kind])))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--against", help="another checkout: restarts of its engine against this one's, alternating"
    )
    ap.add_argument("--json", help="write the runs and medians here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.against:
            runs = against(args.model, args.reps, Path(tmp), str(Path(args.against).resolve()))
        else:
            runs = first_and_restart(args.model, args.reps, Path(tmp))
    names = [p for p, _ in MARKS] + ["ready"]
    medians = {kind: {p: statistics.median(r[p] for r in rs) for p in names} for kind, rs in runs.items()}
    print(f"CPU: {cpu_model()}; model {args.model}; median of {args.reps}, seconds")
    width = max(12, *(len(kind) + 1 for kind in medians))
    print(f"{'':{width}}" + "".join(f"{p:>10}" for p in names))
    for kind, m in medians.items():
        print(f"{kind:{width}}" + "".join(f"{m[p]:10.2f}" for p in names))
    (one, one_m), (other, other_m) = medians.items()
    print(f"{other}: {other_m['ready'] / one_m['ready']:.2f}x the ready time of {one}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cpu": cpu_model(), "runs": runs, "medians": medians}, indent=1)
        )


if __name__ == "__main__":
    main()
