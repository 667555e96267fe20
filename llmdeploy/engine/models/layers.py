"""Building blocks shared by the model files: norms and the MLP activation call the kernel ops so the Triton
backend replaces them on CUDA; weights of fused projections are loaded shard by shard."""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from llmdeploy.kernels import cpu_native, native_build
from llmdeploy.kernels.cpu_flags import cpu_flags
from llmdeploy.kernels.decode_step import LinearKind, NativeLinear


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: ModuleType):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps, self.ops = eps, ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual) normalised; returns (normed, x + residual) for the next fused add."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up (on CPU one native pass: float32, and bf16 with AVX-512)."""
    fused = cpu_native.silu_and_mul(x)
    if fused is not None:
        return fused
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


class MergedLinear(nn.Linear):
    """One matmul for several projections of the same input (q|k|v, gate|up); shard_sizes are row counts."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size

    def shard(self, param: torch.Tensor, shard_id: str) -> torch.Tensor:
        start, size = self.shard_offsets[shard_id]
        return param.data.narrow(0, start, size)


@functools.cache
def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN can pack and run a linear layer of `dtype` on this CPU. Probed by doing it: the bf16 path
    needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, which an AVX2-only CPU (e.g. AMD EPYC Zen 3) lacks (issue 11)."""
    ops = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    ):
        return False
    try:
        packed = ops._reorder_linear_weight(torch.ones(8, 8, dtype=dtype))
        ops._linear_pointwise(torch.ones(2, 8, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def packed_linear_available(dtype: torch.dtype) -> bool:
    """Whether PackedLinear has a kernel for `dtype` here beyond F.linear: the native one (float32 on AVX2 or
    AVX-512, bf16 on AVX-512 BF16 or AVX2) or oneDNN's packed GEMM."""
    native = (
        cpu_native.bf16_linear_available() if dtype == torch.bfloat16 else cpu_native.f32_linear_available()
    )
    return native or onednn_linear_available(dtype)


# Packed linear layers by handle, for compiled code (PackedLinear.handle). Entries live as long as the process:
# a model is loaded once per engine process.
PACKED_LINEARS: list[PackedLinear] = []


@torch.library.custom_op("llmdeploy::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """PackedLinear as an op torch.compile treats as opaque: the layers' handles are graph inputs (buffers), so
    the 30 layers still share one compiled graph, and the elementwise work around the GEMMs is fused."""
    return PACKED_LINEARS[int(handle)].run(x)


@packed_linear.register_fake
def _packed_linear_shape(
    x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


# Where the CPU has AMX, a bfloat16 layer keeps oneDNN's AMX copy of its weight for prefill's many rows and runs
# the native kernel up to these many (bench/linear_rows.py, Xeon with AMX, 2026-12-04, all of a step's
# projections): on its own AMX tiles 0.81-0.91x oneDNN's time at 4-32 rows, 1.12x at 48, 1.27x at 256; where it
# may not use them (LLMDEPLOY_AMX_MIN_ROWS=0) vdpbf16ps alone: 0.73x at 1 row, 0.93x at 4, 1.11x at 8, 1.69x at 16.
# Without AMX the native kernel runs every row count on one copy (within 8% of oneDNN's bf16 GEMM at 2048 rows on
# Zen 4, 1.4x it at one row: bench/RESULTS.md).
BF16_NATIVE_MAX_ROWS_WITH_AMX = 32
BF16_NATIVE_MAX_ROWS_WITHOUT_AMX_TILES = 4


class PackedLinear(nn.Module):
    """A loaded nn.Linear whose weight is reordered once into a GEMM's blocked layout (CPU only): the native
    kernels' tiles where the CPU has AVX-512 or AVX2 + FMA (float32, and bfloat16 through vdpbf16ps or widened on AVX2)
    (kernels/cpu_native.py: 1.4-1.6x oneDNN at one row on Zen 4, where decode is bandwidth-bound, and on par at 2048
    rows; the AVX2 kernel 0.70-0.92x oneDNN's time at 1-512 rows on Zen 2; bench/RESULTS.md), else oneDNN's.

    oneDNN against torch's MKL path (2 threads, float32): 2x faster from 4 rows up (the LM head at 32 rows:
    21 ms -> 7 ms) and 1.4x at one row; bfloat16 gains 1.1-3x. Same fp32 accuracy (different summation order)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, amx: bool | None = None, register: bool = True
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.native = cpu_native.native_pack(weight)  # None: another dtype, or the CPU lacks the instructions
        amx = has_amx() if amx is None else amx
        bf16_both = self.native is not None and self.dtype == torch.bfloat16 and amx
        self.native_max_rows = None
        if bf16_both:
            tiles = native_build.amx_linear_rows() > 0
            self.native_max_rows = (
                BF16_NATIVE_MAX_ROWS_WITH_AMX if tiles else BF16_NATIVE_MAX_ROWS_WITHOUT_AMX_TILES
            )
        # no batch-size hint: oneDNN then picks a layout that is faster at every row count measured here (30
        # layers' projections, 2 threads, fp32: 1 row 11.8 -> 8.7 ms, 32 rows 25.5 -> 19.5, 256 rows 120 -> 112;
        # the LM head at 32 rows 6.7 -> 5.0) than the layout tuned for one row
        self.packed = (
            torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            if (self.native is None or bf16_both) and onednn_linear_available(self.dtype)
            else None
        )
        # neither kernel takes this dtype here (bf16 on a CPU without AVX2): F.linear on the weight as it came
        self.dense = weight.detach() if self.native is None and self.packed is None else None
        self.bias = None if bias is None else bias.detach().to(self.dtype).contiguous()
        # torch.compile cannot trace an opaque packed tensor: compiled code reaches this module through the handle
        self.register_buffer("handle", torch.tensor(len(PACKED_LINEARS)), persistent=False)
        # a layer only timed (engine/cpu_dtype.py) is never compiled, and its memory goes with it
        if register:
            PACKED_LINEARS.append(self)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and (
            self.native_max_rows is None or x.numel() <= self.native_max_rows * x.shape[-1]
        ):
            out = cpu_native.native_linear(x, self.native, self.bias, self.out_features)
            if out is not None:
                return out
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)  # rows of another dtype: the dense copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle, self.bias, self.out_features)
        return self.run(x)

    def native_linear(self) -> NativeLinear | None:
        """This layer for the native decode step (kernels/decode_step.py); None where only oneDNN runs it."""
        if self.native is None:
            return None
        kind = LinearKind.BF16 if self.dtype == torch.bfloat16 else LinearKind.F32
        return NativeLinear(kind, self.native, self.bias, self.out_features, self.in_features)

    @property
    def weight(self) -> torch.Tensor:  # a dense copy, for inspection
        if self.dense is not None:
            return self.dense
        if self.native is None:
            return self.packed.to_dense()
        return native_rows(self.native, self.in_features, torch.arange(self.out_features))


def native_rows(native: torch.Tensor, k: int, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [...] of a weight [N, k] from its native pack (cpu_native.f32_pack: [tiles, k, tile]; bf16_pack:
    [tiles, k/2, tile, 2]) -> [..., k], the values as they were packed."""
    tile, flat = cpu_native.F32_TILE, index.reshape(-1)
    t, c = flat // tile, flat % tile
    if native.dtype == torch.bfloat16:
        rows = native.view(-1, k // 2, tile, 2)[t, :, c, :].reshape(-1, k)
    else:
        rows = native.view(-1, k, tile)[t, :, c]
    return rows.reshape(*index.shape, k)


class PackedEmbedding(nn.Module):
    """A tied model's embedding read from its packed head (a PackedLinear with a native pack) instead of a table of
    its own. Why: packing gives the head its own copy of the tied weight, so the model held it twice (SmolLM2-135M
    float32: 113 MB of a 1.33 GB engine). A row is a strided gather (values a tile's 32 channels apart): ~0.3% of a
    256-token prefill chunk, nothing at decode's few ids; the native decode step reads the head's rows the same way."""

    def __init__(self, head: PackedLinear):
        super().__init__()
        assert head.native is not None, "only a native pack has the row layout read here"
        self.packed, self.dtype = head.native, head.dtype  # a plain attribute: the head owns the tensor
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.num_embeddings):
            raise IndexError("index out of range in self")  # as nn.Embedding says it (the tiles are padded)
        return native_rows(self.packed, self.embedding_dim, input_ids)

    @property
    def weight(self) -> torch.Tensor:  # a dense copy, for inspection
        return native_rows(self.packed, self.embedding_dim, torch.arange(self.num_embeddings))


@functools.cache
def has_amx() -> bool:
    return "amx_bf16" in cpu_flags()


def pack_linears(model: nn.Module) -> None:
    """Replaces every nn.Linear of `model` by a PackedLinear (a head tied to the embedding gets its own copy)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child.weight, child.bias))
