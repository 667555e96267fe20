"""The Llama family on a paged KV cache: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm),
SmolLM2 (Llama with tied embeddings). q/k/v and gate/up are fused into one projection each at load time."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from llmdeploy.engine.attention import AttentionMetadata, PagedAttention
from llmdeploy.engine.models.layers import (
    MergedLinear,
    PackedEmbedding,
    PackedLinear,
    RMSNorm,
    pack_linears,
    silu_and_mul,
)
from llmdeploy.engine.models.native_step import NativeDecode
from llmdeploy.engine.models.quant import BlockWeights, QuantLinear, concat_rows, quantize_linears
from llmdeploy.engine.parallel.group import all_reduce
from llmdeploy.engine.parallel.shard import Shard, Split
from llmdeploy.engine.rope import build_cos_sin_cache
from llmdeploy.kernels import cpu_native, get_ops
from llmdeploy.kernels.decode_step import BurstDraw

# checkpoint projection name -> (fused module, shard)
STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# checkpoint projection -> how tensor parallelism splits it (parallel/shard.py); everything else is replicated
SPLITS: dict[str, Split] = {
    "q_proj": "column",
    "k_proj": "column",
    "v_proj": "column",
    "gate_proj": "column",
    "up_proj": "column",
    "o_proj": "row",
    "down_proj": "row",
}


# what the layers rotate q and k with: the whole cos/sin table (backends with their own rotary op) or this step's
# (cos, sin) rows, built once per forward for all layers (the torch ops: ~10 fewer small ops per layer)
Rope = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def paged_attention(
    attn: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """Opaque to torch.compile: the metadata carries per-step ints and lists that would force recompiles."""
    return attn(q, k, v, meta)


def attend(attn: PagedAttention, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Attention over the cache with this step's K/V already stored (see rope_and_store)."""
    return attn.attend(q, meta)


def rope_and_store(
    attn: PagedAttention, qkv: torch.Tensor, h: int, hkv: int, rope: Rope, meta: AttentionMetadata
) -> bool:
    """The native fused rotary + K/V store on the fused qkv rows (kernels/cpu_native.py); False where it does not
    apply (another backend, dtype or device; no C compiler; inside torch.compile): the torch ops run instead."""
    if isinstance(rope, torch.Tensor) or torch.compiler.is_compiling():
        return False
    cos, sin = rope
    return cpu_native.rope_and_store(qkv, h, hkv, cos, sin, meta.slot_mapping, attn.k_cache, attn.v_cache)


_OPAQUE_TO_COMPILE = ("paged_attention", "attend", "rope_and_store")


def opaque_to_compile() -> None:
    """torch.compiler.disable on the functions above, applied when a model compiles its layers, not at import:
    it imports torch._dynamo, about 3 s at every engine start, and compile is off by default. The layers call the
    functions through this module's globals, so replacing them here is enough."""
    g = globals()
    for name in _OPAQUE_TO_COMPILE:
        if not getattr(g[name], "_torchdynamo_disable", False):
            g[name] = torch.compiler.disable(g[name])


@dataclass(frozen=True)
class LayerOptions:
    """What sets the family's members and a tensor-parallel rank's layers apart, handed down to every layer."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    shard: Shard = Shard()  # this rank's part (the embedding and the head stay whole)


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: str, options: LayerOptions):
        super().__init__()
        shard, qk_norm = options.shard, options.qk_norm
        self.num_heads = shard.part(config.num_attention_heads, "attention heads")  # this rank's heads
        self.num_kv_heads = shard.part(config.num_key_value_heads, "KV heads")
        self.tp_size = shard.size
        self.head_dim = head_dim_of(config)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.ops = get_ops(backend)
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=options.qkv_bias,
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=options.o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, self.ops) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, self.ops) if qk_norm else None
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, backend
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, rope: Rope, meta: AttentionMetadata
    ) -> torch.Tensor:
        h, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(-1, h + 2 * hkv, self.head_dim)
        if self.q_norm is None and rope_and_store(self.attn, qkv, h, hkv, rope, meta):
            # float32 or bf16 on CPU: q and k rotated in place, k and v stored by one native call; attention reads
            out = self.o_proj(attend(self.attn, qkv[:, :h], meta).view(-1, self.q_size))
            return out if self.tp_size == 1 else all_reduce(out)
        q, k, v = qkv.split([h, hkv, hkv], dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        if isinstance(rope, torch.Tensor):  # the backend's own rotary op over the whole cos/sin table
            q, k = self.ops.rotary_embedding(positions, q, k, rope)
        else:  # this step's tables; q's and k's heads are adjacent in qkv, so they rotate in one pass
            qk = qkv[:, : h + hkv] if self.q_norm is None else torch.cat((q, k), dim=1)
            qk = self.ops.apply_rotary(qk, *rope)
            q, k = qk[:, :h], qk[:, h:]
        o = paged_attention(self.attn, q, k, v, meta)
        out = self.o_proj(o.view(-1, self.q_size))
        return out if self.tp_size == 1 else all_reduce(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, bias: bool, shard: Shard = Shard()):
        super().__init__()
        size = shard.part(config.intermediate_size, "MLP rows (intermediate_size)")
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size}, bias=bias)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=bias)
        self.tp_size = shard.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return out if self.tp_size == 1 else all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: str, options: LayerOptions):
        super().__init__()
        ops = get_ops(backend)
        self.self_attn = LlamaAttention(config, backend, options)
        self.mlp = LlamaMLP(config, getattr(config, "mlp_bias", False), options.shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        rope: Rope,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rope, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: str, options: LayerOptions):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, options) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, get_ops(backend))
        self.native_decode = NativeDecode()

    @property
    def embed_dtype(self) -> torch.dtype:
        """The embedding's dtype (a PackedEmbedding has no table to ask)."""
        embed = self.embed_tokens
        return embed.dtype if isinstance(embed, PackedEmbedding) else embed.weight.dtype

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = torch.zeros_like(hidden)  # x + 0 == x: every layer then has the same (compilable) form
        if self.native_decode.run(self, hidden, residual, positions, cos_sin, meta):
            return hidden  # every layer and the final norm in one native call
        ops = self.layers[0].self_attn.ops
        rope = ops.rotary_tables(positions, cos_sin) if hasattr(ops, "apply_rotary") else cos_sin
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, rope, meta)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False

    def __init__(
        self,
        config: PretrainedConfig,
        backend: str = "torch",
        max_positions: int | None = None,
        shard: Shard = Shard(),
    ):
        """`shard`: this rank's part under tensor parallelism (the embedding and the head stay whole)."""
        super().__init__()
        self.config = config
        self.max_positions = max_positions or config.max_position_embeddings
        attention_bias = getattr(config, "attention_bias", False)
        options = LayerOptions(self.qkv_bias or attention_bias, attention_bias, self.qk_norm, shard)
        self.model = LlamaModel(config, backend, options)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.cos_sin_cache = torch.empty(0)

    def pack_for_cpu(self) -> None:
        """After loading, on CPU: every projection in its packed layout (native or oneDNN's); a tied head's native
        pack then serves as the embedding too (PackedEmbedding), so the weight is held once."""
        pack_linears(self)
        head = self.lm_head
        if self.tie_word_embeddings and isinstance(head, PackedLinear) and head.native is not None:
            self.model.embed_tokens = PackedEmbedding(head)

    def quantize_int8(self) -> None:
        """After loading (model.quantization: int8): every projection, the head too, as Q8 blocks."""
        quantize_linears(self)

    def use_block_weights(self, blocks: dict[str, BlockWeights]) -> list[str]:
        """After loading (model.quantization: gguf): each projection whose checkpoint tensors all came as blocks
        (by Hugging Face name) becomes a QuantLinear of them; returns the modules replaced."""
        replaced = []
        for name, module in list(self.named_modules()):
            if not isinstance(module, nn.Linear):
                continue
            parts = [blocks.get(n) for n in self._checkpoint_names(name, module)]
            fused = concat_rows(parts) if all(parts) else None
            if fused is None or fused.out_features != module.out_features:
                continue
            parent, _, attr = name.rpartition(".")
            setattr(self.get_submodule(parent) if parent else self, attr, QuantLinear(fused, module.bias))
            replaced.append(name)
        return replaced

    def _checkpoint_names(self, name: str, module: nn.Linear) -> list[str]:
        """The checkpoint weights a projection was loaded from, in row order (a tied head: the embedding)."""
        if name == "lm_head" and self.tie_word_embeddings:
            return ["model.embed_tokens.weight"]
        if not isinstance(module, MergedLinear):
            return [f"{name}.weight"]
        prefix, _, fused = name.rpartition(".")
        by_shard = {shard: proj for proj, (f, shard) in STACKED.items() if f == fused}
        return [f"{prefix}.{by_shard[shard]}.weight" for shard in module.shard_offsets]

    def finish_loading(self, device: torch.device) -> None:
        """After the weights are in place; re-ties the head, whatever put its weight in place (loader.materialize keeps
        shared weights shared, torch's to_empty does not)."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.cos_sin_cache = build_cos_sin_cache(
            self.config, head_dim_of(self.config), self.max_positions, device
        )

    def compile_layers(self) -> None:
        """Regional torch.compile: the decoder layers share one compiled graph (parameters are graph inputs), so
        the compile cost is that of one layer; attention stays eager (see paged_attention)."""
        opaque_to_compile()
        self.model.native_decode.disable()
        for layer in self.model.layers:
            layer.compile(dynamic=True)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, self.cos_sin_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def decode_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """compute_logits(forward(...)) of a decode-only step in one native call on CPU (engine/models/native_step.py);
        None where that does not apply (the caller then runs both)."""
        return self.model.native_decode.logits(
            self.model, self.lm_head, input_ids, positions, self.cos_sin_cache, meta
        )

    def decode_greedy(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        steps: int,
        yield_flag: ctypes.c_int32 | None = None,
        draw: BurstDraw | None = None,
    ) -> list[list[int]] | None:
        """Up to `steps` greedy (with `draw`: sampled) decode steps in one native call on CPU (fewer once
        `yield_flag` is set): [rows][steps run] token ids; None where that does not apply (the caller then runs
        one ordinary step)."""
        return self.model.native_decode.greedy(
            self.model, self.lm_head, input_ids, positions, self.cos_sin_cache, meta, steps, yield_flag, draw
        )

    def screens_head(self, rows: int) -> bool:
        """Whether decode_greedy at `rows` rows reads the LM head through its screen (built at the first native
        decode step)."""
        return self.model.native_decode.screens_head(rows, self.model.embed_dtype)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @staticmethod
    def split_of(name: str) -> Split | None:
        """How tensor parallelism splits the checkpoint tensor `name` (None: every rank holds all of it)."""
        module_name = name.rpartition(".")[0]
        return SPLITS.get(module_name.rpartition(".")[2])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF checkpoint names -> this module's parameters; raises if any parameter was left unloaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules())
        loaded: set[tuple[str, str]] = set()
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES) or (self.tie_word_embeddings and name.startswith("lm_head.")):
                continue
            module_name, _, param_kind = name.rpartition(".")
            prefix, _, proj = module_name.rpartition(".")
            fused, shard_id = STACKED.get(proj, (proj, ""))
            param_name = f"{prefix}.{fused}.{param_kind}" if shard_id else name
            if param_name not in params:
                raise ValueError(f"checkpoint tensor {name} has no place in {type(self).__name__}")
            param = params[param_name]
            target = modules[f"{prefix}.{fused}"].shard(param, shard_id) if shard_id else param.data
            loaded.add((param_name, shard_id))
            if target.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
        self._check_all_loaded(params, modules, loaded)

    def _check_all_loaded(self, params: dict, modules: dict, loaded: set[tuple[str, str]]) -> None:
        missing = []
        for name in params:
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            module = modules[name.rpartition(".")[0]]
            shards = module.shard_offsets if isinstance(module, MergedLinear) else {"": None}
            missing += [f"{name}[{s}]" if s else name for s in shards if (name, s) not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {', '.join(missing[:5])}")


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
