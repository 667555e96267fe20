"""bench/decode_attention.py runs where the native kernels build: the kernel file compiled alone as a baseline gives
the library's own bits, and the script prints a row per case for both cache layouts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmdeploy.kernels import native_build
from tests.helpers.quick_build import quick_flags

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not native_build.available(), reason="native CPU kernels do not build here")


def test_baseline_build_gives_the_library_bits(tmp_path):
    sys.path.insert(0, str(ROOT))
    from bench.decode_attention import Case, compiled, current, time_case

    source = native_build.SOURCES[0].parent / "decode_attention.c"
    baseline = compiled(source, tmp_path, quick_flags())  # the same bits, compiled sooner
    for dtype in (torch.float32, torch.bfloat16):
        case = Case(dtype, batch=3, context=70, layers=2)
        best, same = time_case(case, [baseline, current()], reps=1)
        assert same and all(t > 0 for t in best)
        assert torch.isfinite(case.out).all()


def test_script_prints_each_case(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "bench/decode_attention.py",
            "--dtypes",
            "float32",
            "--cases",
            "2x40,1x9",
            "--reps",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("float32")]
    assert len(rows) == 6  # two cases in three modes
    assert "behind a weight stream" in proc.stdout and "cold" in proc.stdout and "L3-resident" in proc.stdout


def test_every_mode_times_calls_back_to_back():
    """The L3-resident mode calls one layer's cache as many times as the others call their layers (a lone call
    a run also timed the threads' wake-up)."""
    sys.path.insert(0, str(ROOT))
    from bench.decode_attention import Case

    reused, distinct = Case(torch.float32, 1, 20, 3, distinct=False), Case(torch.float32, 1, 20, 3)
    assert len(reused.caches) == len(distinct.caches) == 3
    assert all(pair is reused.caches[0] for pair in reused.caches)
    assert len({id(k) for k, _ in distinct.caches}) == 3
