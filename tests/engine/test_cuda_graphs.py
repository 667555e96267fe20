"""CUDA graphs for decode (engine/cuda_graphs.py): the size choices, and that CPU engines never use them. The
capture itself needs a GPU (bench/gpu_engine.py)."""

from __future__ import annotations

import pytest
import torch

from llmdeploy.engine import LLM, SamplingParams
from llmdeploy.engine.cuda_graphs import capture_sizes, padded_size, wanted


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    sizes = capture_sizes(40)
    assert sizes == [1, 2, 4, 8, 16, 24, 32, 40]
    assert all(padded_size(b, sizes) >= b for b in range(1, 41))
    assert padded_size(3, sizes) == 4 and padded_size(33, sizes) == 40
    assert padded_size(41, sizes) is None  # wider than captured: eager
    assert capture_sizes(1) == [1]


def test_only_cuda_with_triton_kernels(monkeypatch):
    assert not wanted(torch.device("cpu"), "torch")
    assert wanted(torch.device("cuda"), "triton")
    monkeypatch.setenv("LLMDEPLOY_CUDA_GRAPHS", "0")
    assert not wanted(torch.device("cuda"), "triton")


def test_cpu_engine_runs_without_graphs(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_gb=0.01)
    assert llm.engine.runner.decode_graphs is None
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_decode_matches_eager(tiny_llama, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(5)]
    graphs = LLM(model=str(tiny_llama), dtype="float32", device="cuda", max_model_len=128, max_num_seqs=8)
    assert graphs.engine.runner.decode_graphs is not None
    with_graphs = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    monkeypatch.setenv("LLMDEPLOY_CUDA_GRAPHS", "0")
    eager = LLM(model=str(tiny_llama), dtype="float32", device="cuda", max_model_len=128, max_num_seqs=8)
    assert eager.engine.runner.decode_graphs is None
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, params)] == with_graphs
