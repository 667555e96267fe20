"""Tiny random Llama/Mistral/Qwen2/Qwen3 checkpoints made at test time (no hub): config + safetensors +
a small byte-level BPE tokenizer with a ChatML template, saved as a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "Hello world! How are you today? I am fine, thank you very much.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ' \" ! ? @ # $ % ^ & _ ~ `",
    "def main():\n    print('hi')\n    return 42\n",
    "Continuous batching with a paged KV cache serves many requests at once.",
]


def make_tokenizer(out_dir: Path, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML
    fast.save_pretrained(out_dir)
    return fast


ARCH_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


def make_tiny_model(out_dir: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random model of `arch` with the tiny tokenizer; returns the folder."""
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(out_dir)
    config_cls, model_cls, extra = ARCH_CONFIGS[arch]
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random init is tiny; widen it so greedy choices are not near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
