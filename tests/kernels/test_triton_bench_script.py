"""bench/gpu_kernels.py runs: --help, the no-CUDA message, and its kernel part on CPU under the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_kernels.py"


def run_script(*args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1") if interpret else dict(os.environ)
    if not interpret:
        env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )


def test_help():
    proc = run_script("--help")
    assert proc.returncode == 0 and "--quick" in proc.stdout and "--peak-gbps" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_says_nothing_measured(tmp_path):
    out = tmp_path / "r.json"
    proc = run_script("--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device; nothing measured" in proc.stdout
    assert json.loads(out.read_text())["measured"] is False


@pytest.mark.full  # CI's time budget: scripts/test.sh -m full
def test_quick_kernel_part_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    proc = run_script("--quick", "--device", "cpu", "--peak-gbps", "100", "--out", str(out), interpret=True)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    triton_ops = {r["op"] for r in result["kernels"] if r["impl"] == "triton"}
    assert triton_ops == {"decode", "prefill", "store_kv", "rms_norm", "rotary"}
    assert all(r["ms"] > 0 and r["peak_frac"] is not None for r in result["kernels"])
    assert {"decode", "prefill"} <= set(result["sweeps"]) and all(result["sweeps"].values())
    assert "skipped" in result["engine"]
    assert "decode" in proc.stdout and "engine: skipped" in proc.stdout


@pytest.mark.full  # 25 s of interpreted Triton; test_quick_kernel_part_on_cpu runs the same script's plumbing
def test_engine_part_logic_on_cpu_with_a_tiny_config():
    """The GPU-only engine comparison, run on CPU (interpreted kernels) with a tiny config, so its plumbing
    (random model + tokenizer, transformers' static batches, the engine's warm-up and timed run) is checked."""
    from bench.gpu_engine import bench_engine
    from bench.gpu_kernels import parse_args

    args = parse_args(
        ["--requests", "3", "--prompt-len", "20", "--output-len", "3", "--hf-batch-sizes", "2,3"]
    )
    args.model, args.max_num_batched_tokens = "tiny-llama", 32
    cfg = dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    result = bench_engine(args, cfg, device="cpu")
    assert "error" not in result, result.get("error")
    assert [r["batch_size"] for r in result["transformers_runs"]] == [2, 3]
    assert result["transformers"]["output_tokens"] == result["llmdeploy"]["output_tokens"] == 9
    # plumbing only: the interpreted kernels' speed depends on the machine, so no ratio is judged here
    assert isinstance(result["speedup"], float) and result["speedup"] >= 0
    assert isinstance(result["met"], bool)
    for side in ("transformers", "llmdeploy"):
        assert isinstance(result[side]["output_tokens_per_s"], float)
