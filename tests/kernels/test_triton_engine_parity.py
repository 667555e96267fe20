"""The engine with kernel_backend="triton" (interpreted on CPU) generates transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_cases import DEVICE

PROMPTS = [
    "The quick brown fox",
    "Hello world! How are you today? I am fine, thank you very much. Paris is",  # > one 16-token block
    "def main():",
]
MAX_TOKENS = 6


def hf_greedy(folder, prompt_ids: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:  # one at a time: no padding, so nothing but the kernels can differ
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
            )
            outs.append(out[0, len(ids) :].tolist())
    return outs


@pytest.mark.parametrize(
    "overrides", [{}, {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}]
)
def test_engine_greedy_parity_with_triton_backend(tiny_model, overrides):
    """head_dim 16 (the default tiny Llama, GQA 2) and head_dim 64 (GQA 2, one kv head). block_size 16 and a
    small batched-token budget make the longer prompt cross a block boundary and arrive in chunks."""
    try:
        from llmdeploy.engine import LLM, SamplingParams
    except ImportError as exc:  # the engine core lands separately; this test must fail, not skip, without it
        pytest.fail(f"llmdeploy.engine.LLM is not importable yet: {exc}")
    folder = tiny_model("llama", **overrides)
    llm = LLM(
        model=str(folder),
        kernel_backend="triton",
        device=DEVICE,
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=128,
        prefix_caching=False,
    )
    layers = llm.engine.runner.model.attention_layers()
    assert all(layer.ops.__name__ == "llmdeploy.kernels.triton_ops" for layer in layers)
    prompt_ids = llm.encode(PROMPTS)
    assert max(map(len, prompt_ids)) > 16
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(folder, prompt_ids)
