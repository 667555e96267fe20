"""The native decode step (csrc/decode_step.c): a decode-only step's decoder layers in one ctypes call.

The model side (engine/models/native_step.py) describes each layer's weights once; here they become the C
structs, and `DecodeLayers.run` hands a step's buffers to the kernel. Everything the kernel checks is also
checked here first, so a None from `run` (the caller then runs the Python layers) leaves no state half-updated."""

from __future__ import annotations

import ctypes
import enum
import functools
import os
from dataclasses import dataclass

import torch

from llmdeploy.kernels import cpu_native, native_build, native_quant

ENV_SWITCH = "LLMDEPLOY_NATIVE_DECODE"  # =0: the Python layers at every step (the benchmarks' baseline)


class LinearKind(enum.IntEnum):
    """Which native kernel a projection's packed weight is for (LIN_* in decode_step.c)."""

    F32 = 0  # llmd_f32_linear
    BF16 = 1  # llmd_bf16_linear
    Q = 2  # llmd_q_linear / llmd_q_bf16_linear (float layout, float32 activations)
    QV = 3  # llmd_qv_linear (VNNI layout, float32 activations)


@dataclass(frozen=True)
class NativeLinear:
    kind: LinearKind
    weight: torch.Tensor  # packed for the kind's kernel
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    fmt: int = 0  # QFormat for Q / QV


@dataclass(frozen=True)
class NativeLayer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: NativeLinear
    o: NativeLinear
    gate_up: NativeLinear
    down: NativeLinear
    k_cache: torch.Tensor
    v_cache: torch.Tensor


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


@dataclass(frozen=True)
class BurstDraw:
    """A sampled burst's draw (llmd_draw): per row 1 / temperature (0: the row stays greedy) and min_p, and the
    uniform numbers of every step, step-major (u[j * rows + n]); per row top_k (0: none) and top_p (1: none), or
    None where no row has either."""

    inv_temp: list[float]
    min_p: list[float]
    u: list[float]
    top_k: list[int] | None = None
    top_p: list[float] | None = None

    def struct(self) -> _Draw:
        m = len(self.inv_temp)
        filtered = self.top_k is not None and self.top_p is not None
        return _Draw(
            (ctypes.c_float * m)(*self.inv_temp),
            (ctypes.c_float * m)(*self.min_p),
            (ctypes.c_double * len(self.u))(*self.u),
            (ctypes.c_int64 * m)(*cpu_native.kernel_top_k(self.top_k)) if filtered else None,
            (ctypes.c_double * m)(*cpu_native.float32_top_p(self.top_p)) if filtered else None,
        )


class _Draw(ctypes.Structure):
    _fields_ = [
        ("inv_temp", ctypes.POINTER(ctypes.c_float)),
        ("min_p", ctypes.POINTER(ctypes.c_float)),
        ("u", ctypes.POINTER(ctypes.c_double)),
        ("top_k", ctypes.POINTER(ctypes.c_int64)),
        ("top_p", ctypes.POINTER(ctypes.c_double)),
    ]


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("fmt", ctypes.c_int32),
        ("w", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("in_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
    ]


class _Screen(ctypes.Structure):
    _fields_ = [
        ("q8", ctypes.c_void_p),
        ("c_x1", ctypes.c_void_p),
        ("max_tiles", ctypes.c_int64),
        ("bf16", ctypes.c_void_p),
        ("c_l2", ctypes.c_void_p),
    ]


@dataclass(frozen=True)
class HeadScreen:
    """The LM head's screen (csrc/head_screen.c; built by engine/models/head_screen.py): the Q8 copy in
    llmd_q_linear's layout and its per-row bound coefficient, the candidate tiles a row beyond which it declines,
    and for a float32 head on a CPU with bf16 products its bf16 copy (llmd_bf16_pack's layout) with the L2 bound's
    two coefficients a row."""

    q8: torch.Tensor  # uint8
    c_x1: torch.Tensor  # float32 [vocab]
    max_tiles: int
    bf16: torch.Tensor | None = None  # bf16, packed
    c_l2: torch.Tensor | None = None  # float32 [vocab, 2]: A, B

    def struct(self) -> _Screen:
        copy = (
            (self.bf16.data_ptr(), self.c_l2.data_ptr())
            if self.bf16 is not None and self.c_l2 is not None
            else (None, None)
        )
        return _Screen(self.q8.data_ptr(), self.c_x1.data_ptr(), self.max_tiles, *copy)

    @functools.cached_property
    def _takes_struct(self) -> _Screen:  # built once: `takes` is asked at every greedy decode step
        return self.struct()

    def takes(self, rows: int, act_bf16: bool) -> bool:
        """Whether a greedy step of `rows` rows reads the head through this screen."""
        struct = ctypes.byref(self._takes_struct)
        return bool(native_build.library().llmd_head_screen_takes(struct, int(act_bf16), rows))


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0" and native_build.library() is not None


def _linear(lin: NativeLinear) -> _Linear:
    bias = None if lin.bias is None else lin.bias.data_ptr()
    return _Linear(int(lin.kind), lin.fmt, lin.weight.data_ptr(), bias, lin.out_features, lin.in_features)


class DecodeLayers:
    """One model's layers as the kernel's structs; the tensors are held so the pointers stay valid. With the
    model's embedding table and a native LM head, `logits` runs a whole decode step from token ids."""

    def __init__(
        self,
        layers: list[NativeLayer],
        dims: Dims,
        dtype: torch.dtype,
        final_norm: torch.Tensor,
        embed: torch.Tensor | None = None,
        head: NativeLinear | None = None,
        screen: HeadScreen | None = None,
        embed_in_head: bool = False,
    ):
        """embed_in_head: a tied model's embedding is its packed float32 / bf16 head's rows (layers.PackedEmbedding;
        `embed` is then None)."""
        self.layers, self.dims, self.dtype, self.final_norm = layers, dims, dtype, final_norm
        self.structs = (_Layer * len(layers))(
            *(
                _Layer(
                    layer.in_norm.data_ptr(),
                    layer.post_norm.data_ptr(),
                    _linear(layer.qkv),
                    _linear(layer.o),
                    _linear(layer.gate_up),
                    _linear(layer.down),
                    layer.k_cache.data_ptr(),
                    layer.v_cache.data_ptr(),
                )
                for layer in layers
            )
        )
        self.block_size = layers[0].k_cache.shape[1]
        own_table = embed is not None and embed.dtype == dtype and embed.is_contiguous()
        head_kind = LinearKind.BF16 if dtype == torch.bfloat16 else LinearKind.F32
        from_head = embed_in_head and head is not None and head.kind == head_kind
        whole = head is not None and (own_table or from_head)
        self.embed, self.head = (embed if own_table else None, head) if whole else (None, None)
        self.head_struct = _linear(head) if whole else None
        # the head's screen answers greedy steps at a few rows (llmd_decode_greedy): the steps it answered and the
        # candidate tiles they computed (the head has ceil(vocab / 32))
        self.screen = screen if whole else None
        self.screen_struct = self.screen.struct() if self.screen is not None else None
        self.screened_steps = self.screened_tiles = 0

    def _step_args(
        self,
        m: int,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        slot_mapping: torch.Tensor | None,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> tuple | None:
        """The kernel's arguments from M on, or None where it does not take these buffers. Without a slot mapping
        (llmd_decode_greedy: each step's slots come from the tables) the slot pointer is left out."""
        d = self.dims
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        slots_fit = slot_mapping is None or (
            slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.numel() == m
        )
        if not (
            slots_fit
            and positions.dtype == torch.int64
            and positions.is_contiguous()
            and positions.numel() == m
            and cos_sin.dtype == torch.float32
            and cos_sin.is_contiguous()
            and cos_sin.dim() == 2
            and cos_sin.shape[1] == d.head_dim
            and tables.shape[0] == lens.numel() == m
        ):
            return None
        slots = () if slot_mapping is None else (slot_mapping.data_ptr(),)
        return (
            m,
            d.hidden,
            d.heads,
            d.kv_heads,
            d.head_dim,
            d.intermediate,
            d.eps,
            positions.data_ptr(),
            cos_sin.data_ptr(),
            cos_sin.shape[0],
            *slots,
            tables.data_ptr(),
            tables.stride(0),
            lens.data_ptr(),
            self.block_size,
            d.scale,
            native_quant.Q_BF16_MIN_ROWS,
            native_build.threads(),
            (tables, lens),  # held until the call returns; dropped by the callers
        )

    def run(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> bool:
        """Every layer, then the final norm: hidden [M, E] becomes the model's output (residual is scratch).
        positions [M] index the model's rotary cache cos_sin [max_pos, head_dim] (float32). False (nothing
        changed) where the kernel does not take these buffers."""
        m = hidden.shape[0]
        args = self._step_args(m, positions, cos_sin, slot_mapping, block_tables, context_lens)
        if args is None or not (
            hidden.dtype == residual.dtype == self.dtype
            and hidden.is_contiguous()
            and residual.is_contiguous()
            and hidden.shape == residual.shape == (m, self.dims.hidden)
        ):
            return False
        rc = native_build.library().llmd_decode_layers(
            int(self.dtype == torch.bfloat16),
            len(self.layers),
            ctypes.addressof(self.structs),
            self.final_norm.data_ptr(),
            hidden.data_ptr(),
            residual.data_ptr(),
            *args[:-1],
        )
        return _ran(rc)

    def logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor | None:
        """The embedding of input_ids [M], every layer, the final norm and the LM head: float32 logits [M, vocab],
        the values of the Python path's `lm_head(hidden).float()`. None (nothing changed) where this model has no
        native head or the kernel does not take these buffers."""
        m = input_ids.numel()
        model = self._whole_model(input_ids)
        args = self._step_args(m, positions, cos_sin, slot_mapping, block_tables, context_lens)
        if model is None or args is None:
            return None
        out = torch.empty(m, self.head.out_features, dtype=torch.float32)
        rc = native_build.library().llmd_decode_logits(*model, out.data_ptr(), *args[:-1])
        return out if _ran(rc) else None

    def _whole_model(self, input_ids: torch.Tensor) -> tuple | None:
        """The arguments a call from token ids starts with (llmd_decode_logits, llmd_decode_greedy), or None where
        this model has no native head or the ids are not a contiguous int64 vector."""
        if self.head is None or input_ids.dtype != torch.int64 or not input_ids.is_contiguous():
            return None
        return (
            int(self.dtype == torch.bfloat16),
            len(self.layers),
            ctypes.addressof(self.structs),
            self.final_norm.data_ptr(),
            None if self.embed is None else self.embed.data_ptr(),  # None: the head's rows (embed_in_head)
            self.head.out_features if self.embed is None else self.embed.shape[0],
            input_ids.data_ptr(),
            ctypes.addressof(self.head_struct),
        )

    def greedy(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        steps: int,
        yield_flag: ctypes.c_int32 | None = None,
        draw: BurstDraw | None = None,
    ) -> list[list[int]] | None:
        """Up to `steps` decode steps from input_ids [M] at positions [M], each row's next input its greedy token
        (the first index of its largest logit), or with `draw` the token drawn as the sampler draws it: [M][steps
        run] token ids; once `yield_flag` is non-zero the burst ends after the step under way. The block tables
        must cover every position up to positions + steps - 1. None (nothing written) where `logits` would
        decline or a position passes the tables or the rotary cache, or no step ran. With a head screen, greedy
        steps of a few rows read the head through it (the same tokens)."""
        m = input_ids.numel()
        model = self._whole_model(input_ids)
        args = self._step_args(m, positions, cos_sin, None, block_tables, context_lens)
        if model is None or args is None or steps < 1:
            return None
        tokens, done, screened = (ctypes.c_int64 * (m * steps))(), ctypes.c_int64(0), (ctypes.c_int64 * 2)()
        flag = None if yield_flag is None else ctypes.byref(yield_flag)
        screen = None if self.screen_struct is None else ctypes.byref(self.screen_struct)
        drawn = None if draw is None else ctypes.byref(draw.struct())
        rc = native_build.library().llmd_decode_greedy(
            *model, screen, tokens, steps, flag, ctypes.byref(done), screened, drawn, *args[:-1]
        )
        if not _ran(rc) or done.value == 0:
            return None
        self.screened_steps += screened[0]
        self.screened_tiles += screened[1]
        flat = list(tokens)
        return [flat[n * steps : n * steps + done.value] for n in range(m)]


def _ran(rc: int) -> bool:
    if rc in (-1, -3):  # shapes it does not take, or out of memory: nothing written
        return False
    if rc != 0:
        raise RuntimeError(f"native decode step failed (code {rc})")
    return True
