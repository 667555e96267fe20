"""A GGUF file's projection weights in their own quantized blocks (model.quantization: gguf): Q8_0, Q4_0 and Q4_1
tensors become BlockWeights under their Hugging Face names, q/k rows put back in Hugging Face order (llama.cpp's
converter interleaves them for its rotary layout); other types (F16, K-quants) are left to the dequantized
checkpoint the loader already read."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from llmdeploy.engine.models.quant import BlockWeights
from llmdeploy.kernels.native_quant import Q_BLOCK, QFormat

# GGUF tensor name -> Hugging Face checkpoint name ({} = layer index)
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output": "lm_head"}
LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # what the native kernel reads (csrc/q_linear.c)


def hf_name(gguf_name: str) -> str | None:
    if (m := LAYER_NAME.fullmatch(gguf_name)) and m.group(2) in LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{LAYER_TENSORS[m.group(2)]}.weight"
    base = gguf_name.removesuffix(".weight")
    return f"{MODEL_TENSORS[base]}.weight" if base in MODEL_TENSORS else None


def parse_blocks(kind: str, raw: np.ndarray, in_features: int) -> BlockWeights:
    """raw: uint8 [N, bytes per row] of GGUF blocks (little-endian float16 scales first) -> BlockWeights."""
    n = raw.shape[0]
    blocks = raw.reshape(n, in_features // Q_BLOCK, -1)
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0])
    if kind == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(n, in_features)
        return BlockWeights(QFormat.Q8, q, d, None, in_features)
    if kind == "Q4_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
        qs = blocks[..., 4:]
    else:  # Q4_0: w = d * (q - 8), i.e. m = -8 d (exact in float16)
        m = -8 * d
        qs = blocks[..., 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # element j: low nibble of byte j, element j + 16: high
    return BlockWeights(QFormat.Q4, torch.from_numpy(q.reshape(n, in_features)), d, m, in_features)


def unpermute_rows(blocks: BlockWeights, n_head: int) -> BlockWeights:
    """The inverse of llama.cpp's q/k row interleave (per head: rows 2i, 2i+1 <- i, i + half)."""
    n = blocks.out_features
    index = torch.arange(n).reshape(n_head, n // n_head // 2, 2).transpose(1, 2).reshape(n)
    return blocks.rows(index)


def read_block_weights(path: Path, n_head: int, n_kv_head: int) -> dict[str, BlockWeights]:
    """Hugging Face name -> BlockWeights for every projection (and embedding/head) stored in a block type the
    kernel reads."""
    from gguf import GGUFReader

    out: dict[str, BlockWeights] = {}
    for tensor in GGUFReader(str(path)).tensors:
        name = hf_name(tensor.name)
        kind = tensor.tensor_type.name
        if name is None or kind not in BLOCK_TYPES or len(tensor.shape) != 2:
            continue
        in_features = int(tensor.shape[0])
        if in_features % Q_BLOCK:
            continue
        blocks = parse_blocks(kind, np.asarray(tensor.data), in_features)
        if name.endswith("q_proj.weight"):
            blocks = unpermute_rows(blocks, n_head)
        elif name.endswith("k_proj.weight"):
            blocks = unpermute_rows(blocks, n_kv_head)
        out[name] = blocks
    return out
