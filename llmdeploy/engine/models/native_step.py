"""A decode-only step's decoder layers as one native call (kernels/decode_step.py), for the Llama family on CPU.

What it takes: one rank (no tensor parallelism), no per-head q/k norm, every projection on a native kernel
(float32 / bf16 packed, or block-quantized with float32 activations), the torch backend's rotary tables. Anything
else, a step with prefill tokens, or `engine.compile` on: the Python layers run, as before. Same kernels on the
same buffers in the same order, so the output is the Python layers' (tests/engine/test_native_step.py)."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from llmdeploy.engine.attention import AttentionMetadata
from llmdeploy.engine.models import head_screen
from llmdeploy.engine.models.layers import PackedEmbedding
from llmdeploy.kernels import decode_step
from llmdeploy.kernels.decode_step import (
    BurstDraw,
    DecodeLayers,
    Dims,
    HeadScreen,
    LinearKind,
    NativeLayer,
    NativeLinear,
)

if TYPE_CHECKING:
    from llmdeploy.engine.models.llama import LlamaDecoderLayer, LlamaModel


def _native_layer(layer: LlamaDecoderLayer, dtype: torch.dtype) -> NativeLayer | None:
    attn, mlp = layer.self_attn, layer.mlp
    if attn.q_norm is not None or attn.tp_size != 1 or mlp.tp_size != 1:
        return None
    linears = [
        getattr(m, "native_linear", lambda: None)()
        for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    ]
    quantized = (LinearKind.Q, LinearKind.QV)
    if any(lin is None or (lin.kind in quantized and dtype != torch.float32) for lin in linears):
        return None
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    caches = (attn.attn.k_cache, attn.attn.v_cache)
    if any(t.dtype != dtype or not t.is_contiguous() or t.numel() == 0 for t in (*norms, *caches)):
        return None
    return NativeLayer(*(n.detach() for n in norms), *linears, *caches)


def _max_rows(model: LlamaModel, head: torch.nn.Module | None) -> int | None:
    """The fewest rows any projection (the head too) runs natively (PackedLinear.native_max_rows: AMX takes more
    rows)."""
    modules = [*model.modules(), *(head.modules() if head is not None else ())]
    limits = [m.native_max_rows for m in modules if getattr(m, "native_max_rows", None) is not None]
    return min(limits) if limits else None


class NativeDecode:
    """The model's DecodeLayers, built at the first decode step and again when the KV cache or the head moves."""

    def __init__(self) -> None:
        self.off = not decode_step.enabled()
        self.key: tuple | None = None
        self.layers: DecodeLayers | None = None
        self.max_rows: int | None = None
        self.head: torch.nn.Module | None = None  # the LM head `logits` was last asked with
        self.screen_of: torch.nn.Module | None = None  # the head `screen` was built for
        self.screen: HeadScreen | None = None

    def disable(self) -> None:
        """engine.compile: the compiled layers run every step."""
        self.off = True

    def _layers(
        self, model: LlamaModel, dtype: torch.dtype, head: torch.nn.Module | None
    ) -> DecodeLayers | None:
        first, last = model.layers[0].self_attn.attn, model.layers[-1].self_attn.attn
        key = (dtype, first.k_cache.data_ptr(), last.v_cache.data_ptr(), last.v_cache.numel())
        if key != self.key or (head is not None and head is not self.head):
            self.head = head if head is not None else self.head
            self.key, self.layers = key, self._build(model, dtype)
        return self.layers

    def _build(self, model: LlamaModel, dtype: torch.dtype) -> DecodeLayers | None:
        layers = [_native_layer(layer, dtype) for layer in model.layers]
        if any(layer is None for layer in layers):
            return None
        attn = model.layers[0].self_attn
        dims = Dims(
            hidden=model.embed_tokens.embedding_dim,
            heads=attn.num_heads,
            kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            intermediate=layers[0].down.in_features,
            eps=model.layers[0].input_layernorm.eps,
            scale=attn.attn.scale,
        )
        final = model.norm
        rotary = (
            getattr(attn.ops, "apply_rotary", None) is not None
        )  # the torch backend's tables, not Triton's
        if (
            not rotary
            or final.eps != dims.eps
            or final.weight.dtype != dtype
            or not final.weight.is_contiguous()
        ):
            return None
        self.max_rows = _max_rows(model, self.head)
        head = getattr(self.head, "native_linear", lambda: None)()
        in_head = isinstance(model.embed_tokens, PackedEmbedding)  # read from the head's rows (tied)
        embed = None if in_head else model.embed_tokens.weight.detach()
        screen = self._screen(head)
        return DecodeLayers(
            layers, dims, dtype, final.weight.detach(), embed, head, screen, embed_in_head=in_head
        )

    def _screen(self, head: NativeLinear | None) -> HeadScreen | None:
        """The head's Q8 screen for greedy steps at a few rows (engine/models/head_screen.py), built once per head
        (~0.3 s for SmolLM2's on 2 cores, Zen 3): a moved KV cache rebuilds the layers, not this."""
        if head is None or head.kind not in (LinearKind.F32, LinearKind.BF16) or head.bias is not None:
            return None
        if self.screen_of is not self.head:
            self.screen_of, self.screen = self.head, head_screen.build(self.head.weight)
        return self.screen

    def screens_head(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether the layers built last read the head through a screen at `rows` rows (of `dtype` activations)."""
        layers = self.layers
        return (
            not self.off
            and layers is not None
            and layers.screen is not None
            and layers.screen.takes(rows, dtype == torch.bfloat16)
        )

    def _ready(
        self,
        model: LlamaModel,
        dtype: torch.dtype,
        head: torch.nn.Module | None,
        meta: AttentionMetadata,
        rows: int,
    ) -> DecodeLayers | None:
        """The layers for this step, or None where the native step does not take it."""
        if self.off or meta.num_prefill_tokens > 0 or meta.num_decode_tokens != rows:
            return None
        if meta.slot_mapping.device.type != "cpu" or torch.compiler.is_compiling():
            return None
        layers = self._layers(model, dtype, head)
        if layers is None or (self.max_rows is not None and rows > self.max_rows):
            return None
        return layers

    def run(
        self,
        model: LlamaModel,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> bool:
        """Every layer and the final norm over a decode-only step: hidden becomes the model's output (residual
        is overwritten); False: not run, nothing changed."""
        layers = self._ready(model, hidden.dtype, None, meta, hidden.shape[0])
        return layers is not None and layers.run(hidden, residual, positions, cos_sin, *_paging(meta))

    def _from_ids(
        self, model: LlamaModel, head: torch.nn.Module, input_ids: torch.Tensor, meta: AttentionMetadata
    ) -> DecodeLayers | None:
        """The layers for a step from token ids (the embedding's dtype), or None where the native step declines."""
        return self._ready(model, model.embed_dtype, head, meta, input_ids.shape[0])

    def logits(
        self,
        model: LlamaModel,
        head: torch.nn.Module,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """A decode-only step from token ids to the float32 logits of every row (embedding, layers, final norm and
        `head` in one native call), as `head(model(...)).float()` gives them; None: not run, nothing changed."""
        layers = self._from_ids(model, head, input_ids, meta)
        return None if layers is None else layers.logits(input_ids, positions, cos_sin, *_paging(meta))

    def greedy(
        self,
        model: LlamaModel,
        head: torch.nn.Module,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
        steps: int,
        yield_flag: ctypes.c_int32 | None = None,
        draw: BurstDraw | None = None,
    ) -> list[list[int]] | None:
        """Up to `steps` greedy (or with `draw`, sampled) decode steps from token ids in one native call
        (DecodeLayers.greedy): [rows][steps run] token ids, each what the sampler would pick from `logits`'
        output; None: not run."""
        layers = self._from_ids(model, head, input_ids, meta)
        if layers is None:
            return None
        return layers.greedy(
            input_ids,
            positions,
            cos_sin,
            meta.decode_block_tables,
            meta.decode_context_lens,
            steps,
            yield_flag,
            draw,
        )


def _paging(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's slot mapping, block tables and context lengths, as the kernel takes them."""
    return meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens
