"""tensor_parallel without the HTTP server: its YAML rule (FILE:LINE:COL), the engine flag the daemon passes, the
step message, and LLM(..., tensor_parallel=2) token for token against transformers on the Llama variants whose
split differs (q/k/v bias, per-head q/k norms, o and down biases, which rank 0 alone adds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from llmdeploy.control.engine_args import engine_command
from llmdeploy.engine import LLM, SamplingParams
from llmdeploy.engine.attention import AttentionMetadata
from llmdeploy.engine.parallel.shard import ShardError
from llmdeploy.engine.parallel.step import StepInputs, pack, payload_len, unpack
from llmdeploy.spec.loader import load_spec_text
from llmdeploy.spec.models import DeploymentSpec
from tests.engine.test_engine_parity import hf_greedy, prompts

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def spec_text(model: Path, tensor_parallel: int) -> str:
    return (
        f"name: tp\nmodel:\n  path: {model}\nparallel:\n  replicas: 1\n  tensor_parallel: {tensor_parallel}\n"
    )


def test_tensor_parallel_must_split_the_heads_evenly_reported_at_its_line(tiny_llama):
    bad = load_spec_text(spec_text(tiny_llama, 3), "tp.yaml", env={})  # 4 heads, 2 KV heads
    assert bad.spec is None
    (error,) = bad.errors
    assert error.format() == (
        "tp.yaml:6:3: parallel.tensor_parallel: 3 ranks cannot split the model's 4 attention heads and 2 KV "
        "heads evenly; use one of: 1, 2"
    )
    good = load_spec_text(spec_text(tiny_llama, 2), "tp.yaml", env={})
    assert good.spec is not None and not good.errors
    assert not [w for w in good.warnings if w.path.startswith("parallel")]  # apply runs it: no warning


def test_the_daemon_passes_tensor_parallel_to_the_engine_only_above_one():
    assert "--tensor-parallel" not in engine_command(DeploymentSpec(), 8001)
    cmd = engine_command(DeploymentSpec(parallel={"tensor_parallel": 2}), 8001)
    assert cmd[cmd.index("--tensor-parallel") + 1] == "2"


def test_a_step_survives_the_wire_format():
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([16, 17, 18, 40, -1]),
        num_prefill_tokens=3,
        num_decode_tokens=2,
        prefill_cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
        prefill_context_lens=torch.tensor([3], dtype=torch.int32),
        prefill_block_tables=torch.tensor([[1, 0]], dtype=torch.int32),
        prefill_max_q_len=3,
        prefill_max_context_len=3,
        decode_context_lens=torch.tensor([9, 1], dtype=torch.int32),
        decode_block_tables=torch.tensor([[2], [5]], dtype=torch.int32),
        decode_max_context_len=9,
    )
    step = StepInputs(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 1, 2, 8, 0]), meta, [(3, 4), (6, 7)])
    header, payload = pack(step)
    got = unpack(header.tolist(), payload)
    assert payload_len(header.tolist()) == payload.numel()
    assert got.input_ids.tolist() == [5, 6, 7, 8, 9] and got.positions.tolist() == [0, 1, 2, 8, 0]
    assert got.block_copies == [(3, 4), (6, 7)]
    for name, value in vars(meta).items():
        mine = getattr(got.meta, name)
        if isinstance(value, torch.Tensor):
            assert mine.dtype == value.dtype and torch.equal(mine, value), name
        else:
            assert mine == value, name
    decode_only = AttentionMetadata(slot_mapping=torch.tensor([7]), num_prefill_tokens=0, num_decode_tokens=1)
    decode_only.decode_context_lens = torch.tensor([8], dtype=torch.int32)
    decode_only.decode_block_tables = torch.tensor([[0]], dtype=torch.int32)
    header, payload = pack(StepInputs(torch.tensor([3]), torch.tensor([7]), decode_only))
    assert unpack(header.tolist(), payload).meta.prefill_block_tables is None


def with_random_biases(folder: Path) -> Path:
    """The tiny checkpoint's biases are zeros; random ones show a row-split bias added once, not per rank."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


CASES = {
    "llama with o and down biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen2 (q/k/v bias)": ("qwen2", {}),
    "qwen3 (q/k norms)": ("qwen3", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_generate_what_transformers_generates(tiny_model, case):
    arch, overrides = CASES[case]
    path = tiny_model(arch, **overrides)
    if overrides:
        with_random_biases(path)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_gb=0.01, tensor_parallel=2)
    try:
        batch = prompts(6, seed=7, lo=1, hi=90)
        outs = llm.generate(batch, GREEDY)
        for prompt, out in zip(batch, outs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_NEW), (
                f"prompt of {len(prompt)} tokens"
            )
    finally:
        llm.engine.runner.close()
    assert not dist.is_initialized()


def test_one_rank_starts_no_process_group(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=64, kv_cache_gb=0.01)
    assert llm.engine.runner.tp is None and not dist.is_initialized()


def test_a_model_the_ranks_cannot_split_is_refused_before_any_rank_starts(tiny_llama):
    with pytest.raises(ShardError, match="does not divide the model's 4 attention heads"):
        LLM(model=str(tiny_llama), dtype="float32", max_model_len=64, kv_cache_gb=0.01, tensor_parallel=3)
