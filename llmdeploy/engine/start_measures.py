"""What a CPU engine measures at start, kept on disk so that a restart does not time it again.

At start the runner times steps on a scratch cache: the attention probe (engine/attn_probe.py) and the step-cost
calibration (ModelRunner.warmup). On SmolLM2-135M float32 that is ~4 s of a ~14 s start (AMD EPYC Zen 3,
2026-12-07), and it grows with the model. Every restart after a crash, a canary's start and a scale-up paid it again
for the same numbers. Kept here, keyed by everything that makes them differ: the CPU (model, family, stepping,
flags), torch and its thread count, this package's code (kernels included), the model's files (path, size, mtime),
the engine's configuration and the kernel switches in the environment. Any change is a new key, so a stale file is
never read; a file that cannot be read or written is measured anew and the engine starts either way.

Only on CPU with one rank: on CUDA the warm-up's prefill also sizes the KV cache (peak memory), so it runs anyway.
What is kept is a prior: the step-cost model refits it from the engine's own steps (engine/load_stats.py). The same
store keeps `dtype: auto`'s timed choice on CPUs with bf16 units (engine/cpu_dtype.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import llmdeploy
from llmdeploy.engine.config import EngineConfig
from llmdeploy.engine.kept_files import read_kept, write_kept
from llmdeploy.engine.load_stats import CostPoint
from llmdeploy.engine.weights_cache import cache_root
from llmdeploy.kernels.cpu_flags import cpuinfo_lines
from llmdeploy.spec.sources import ModelSource, weight_files

log = logging.getLogger("llmdeploy.engine")
FORMAT_VERSION = 1  # bump when what a file holds changes
# LLMDEPLOY_* names never read into a key: secrets, and what names a process or a folder rather than a kernel (the
# daemon's owner tag differs per replica and revision, which share their measures)
NOT_KERNEL_WORDS = ("TOKEN", "KEY", "SECRET", "PASS", "OWNER", "HOME", "CACHE_DIR")


@dataclass(frozen=True)
class StartMeasures:
    attn_cost_context: float | None  # chunk_cost's constant (None: attention not measurably dearer)
    attn_how: str  # how it was found ("timed at start", "estimated from FLOPs")
    calibration: tuple[CostPoint, ...]  # the warm-up's timed steps


def measures_dir() -> Path:
    return cache_root() / "measures"


@functools.cache
def code_fingerprint() -> str:
    """This package's Python and C sources: a change in any of them may change a step's time (~25 ms to read)."""
    root = Path(llmdeploy.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".c", ".h") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def model_files(source: ModelSource) -> list[list]:
    """[path, size, mtime_ns] of each file the weights and config load from."""
    files = (
        [source.path] if source.kind == "gguf" else [source.path / "config.json", *weight_files(source.path)]
    )
    return [[str(f), (st := f.stat()).st_size, st.st_mtime_ns] for f in files]


def kernel_switches() -> dict[str, str]:
    """The LLMDEPLOY_* settings in the environment (row thresholds, kernels off), without NOT_KERNEL_WORDS' names."""
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if name.startswith("LLMDEPLOY_") and not any(word in name for word in NOT_KERNEL_WORDS)
    }


def machine_ident() -> dict:
    """What makes a timing on this machine differ: the CPU, torch and its threads, this code, the kernel switches."""
    return {
        "format": FORMAT_VERSION,
        "cpu": sorted(set(cpuinfo_lines("vendor_id", "model", "cpu family", "stepping", "flags"))),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "code": code_fingerprint(),
        "env": kernel_switches(),
    }


def kept_path(what: dict) -> Path:
    """The file that keeps the measures of `what` (with machine_ident's) on this machine."""
    ident = {**machine_ident(), **what}
    key = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return measures_dir() / f"{key}.json"


def measures_path(
    config: EngineConfig, source: ModelSource, dtype: torch.dtype, max_model_len: int
) -> Path | None:
    """Where the measures of this engine (over the model `source` it loaded) are kept; None where they cannot be
    keyed (a model file gone since)."""
    try:
        what = {"model": model_files(source), "config": asdict(config), "dtype": str(dtype)}
        return kept_path({**what, "max_model_len": max_model_len})
    except (OSError, ValueError) as exc:
        log.debug("start measures not kept: %s", exc)
        return None


def read_measures(path: Path | None) -> StartMeasures | None:
    """The engine's measures kept at `path`, None where there are none or they are not whole."""
    data = read_kept(path)
    if data is None:
        return None
    try:
        points = tuple(CostPoint(float(p), int(d), float(s)) for p, d, s in data["calibration"])
        context = data["attn_cost_context"]
        measures = StartMeasures(None if context is None else float(context), str(data["attn_how"]), points)
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("start measures %s unreadable (%s): measuring again", path, exc)
        return None
    ctx = measures.attn_cost_context
    numbers = [x for p in points for x in (p.prefill_tokens, p.seconds)] + ([] if ctx is None else [ctx])
    if (
        not points
        or not all(math.isfinite(x) and x >= 0 for x in numbers)
        or min(p.seconds for p in points) <= 0
    ):
        log.warning("start measures %s hold no usable timings: measuring again", path)
        return None
    return measures


def write_measures(path: Path | None, measures: StartMeasures) -> None:
    write_kept(
        path,
        {
            "attn_cost_context": measures.attn_cost_context,
            "attn_how": measures.attn_how,
            "calibration": [[p.prefill_tokens, p.decodes, p.seconds] for p in measures.calibration],
        },
    )
