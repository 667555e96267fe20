"""Write a tiny random Llama (an HF folder from tests/helpers/tiny_models.py) as a float32 GGUF file the way
llama.cpp's converter does (q/k rows permuted, gpt2-style BPE vocabulary, chat template), so the GGUF path and
its conversion cache are tested without the 20 s of the real SmolLM2 file; optionally with block-quantized
tensors (model.quantization: gguf)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in NAMES:
        return NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def write_tiny_gguf(
    folder: Path, out: Path, name: str = "tiny llama", quant: dict[str, str] | None = None
) -> Path:
    """quant: GGUF tensor name or its kind (attn_q, ffn_up, token_embd, ...) -> a block type (Q8_0, Q4_0, Q4_1)
    the tensor is stored in, quantized by gguf-py as llama.cpp's quantizer does; others stay float32."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    template = (
        (folder / "chat_template.jinja").read_text()
        if (folder / "chat_template.jinja").is_file()
        else tok_cfg["chat_template"]
    )
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = GGUFWriter(str(out), "llama")
    w.add_name(name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [added.get(i, t) for t, i in vocab]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_chat_template(template)
    for hf, t in sorted(load_file(str(folder / "model.safetensors")).items()):
        t = t.astype(np.float32)
        if hf.endswith("q_proj.weight"):
            t = permute(t, heads)
        elif hf.endswith("k_proj.weight"):
            t = permute(t, kv_heads)
        kind = (quant or {}).get(gguf_name(hf)) or (quant or {}).get(gguf_name(hf).split(".")[-2])
        if kind is None:
            w.add_tensor(gguf_name(hf), t)
        else:
            qtype = GGMLQuantizationType[kind]
            w.add_tensor(gguf_name(hf), quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
