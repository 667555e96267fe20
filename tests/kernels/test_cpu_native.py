"""The compiled CPU kernels (kernels/cpu_native.py) against the torch definitions: decode attention reading K/V in
place from the paged cache (ragged and long contexts split across threads, GQA groups past one register walk,
head dims, block sizes, bf16 caches, strided queries), the native linears, the portable (non-AVX2) build,
and the fallback when nothing builds."""

from __future__ import annotations

import contextlib
import functools
import math
import platform
from pathlib import Path

import pytest
import torch

from llmdeploy.engine.models.quant import quantize_q8
from llmdeploy.kernels import cpu_native, native_attention, native_build, native_quant
from llmdeploy.kernels import reference as ops
from tests.helpers.quick_build import quick_flags

pytestmark = [
    pytest.mark.skipif(not native_build.available(), reason="native CPU kernels do not build here"),
    pytest.mark.usefixtures("two_threads"),
]


def paged(
    lens: list[int], hkv: int, head_dim: int, block_size: int, dtype=torch.float32, share: int = 0, seed=0
):
    """Random K/V of several sequences in scattered blocks (never block 0); `share` leading blocks of sequence 1
    are sequence 0's (a prefix-cache hit)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 3
    k = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g).to(dtype)
    free = torch.randperm(num_blocks - 1, generator=g).add(1).tolist()
    tables = [[free.pop() for _ in range(b)] for b in blocks]
    if share:
        tables[1][:share] = tables[0][:share]
    width = max(blocks) + 2  # wider than needed: the kernel must not read past context_lens
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k, v, bt, torch.tensor(lens, dtype=torch.int32)


CASES = [  # (lens, kv heads, group, head dim, block size)
    ([1], 3, 3, 64, 16),
    ([15, 16, 17, 31, 32, 33], 2, 4, 64, 16),
    ([200] * 8, 3, 3, 64, 16),
    ([1000], 3, 3, 64, 16),  # one long sequence: split across the threads
    ([1, 600, 2], 1, 8, 32, 32),  # splits, and empty splits for the short ones
    ([5, 300, 7], 2, 12, 32, 16),  # a group wider than one register block (8 heads): blocks of 6
    ([33, 9], 1, 9, 32, 16),  # 9 heads on one kv head: blocks of 3
    ([70, 3], 2, 10, 64, 16),  # blocks of 5
    ([20], 1, 11, 32, 16),  # blocks of 1
    ([40, 41], 4, 1, 128, 16),
    ([19, 64], 2, 5, 80, 32),  # head dim 80: narrower P.V chunks
    ([3, 70], 8, 2, 96, 16),
    ([70, 9], 2, 40, 16, 16),  # 80 heads: past KV_STREAM_HEADS, one stream a split
    ([23, 95, 2], 3, 3, 64, 8),  # token ranges of 24, 96 and 8 tokens split three ways unevenly
    ([300, 5], 2, 4, 128, 16),  # head dim 128 in groups of 4: the AVX-512 P.V's blocks of 2 heads
    ([130, 17], 1, 8, 64, 16),  # 8 heads on one kv head: the AVX-512 P.V's blocks of 6 and 2
]


@pytest.mark.parametrize("lens,hkv,group,head_dim,block_size", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_gather(lens, hkv, group, head_dim, block_size, dtype):
    k, v, bt, cl = paged(
        lens, hkv, head_dim, block_size, dtype, share=1 if len(lens) > 1 and min(lens) > 32 else 0
    )
    q = torch.randn(len(lens), hkv * group, head_dim)
    out = native_attention.decode_attention(q, k, v, bt, cl, head_dim**-0.5)
    assert out is not None and out.shape == q.shape and out.dtype == torch.float32
    # the definition, in float32 math on the same (possibly bf16-rounded) cache contents
    ref = ops.decode_by_gather(q, k.float(), v.float(), bt, cl, head_dim**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("lens,hkv,group,head_dim,block_size", CASES)
def test_decode_bf16_cache_with_bf16_queries_matches_gather(lens, hkv, group, head_dim, block_size):
    """A bf16 model's queries are bf16 values: on AVX-512 BF16 CPUs its cache takes the vdpbf16ps score pass and
    the register-blocked P.V (decode_attention_avx512.c, head dims 32-128 and 64 / 128), elsewhere the 8-lane passes;
    either way the result is the definition's in float32 math."""
    k, v, bt, cl = paged(
        lens, hkv, head_dim, block_size, torch.bfloat16, share=1 if len(lens) > 1 and min(lens) > 32 else 0
    )
    q = torch.randn(len(lens), hkv * group, head_dim).bfloat16().float()
    out = native_attention.decode_attention(q, k, v, bt, cl, head_dim**-0.5)
    assert out is not None and out.shape == q.shape
    ref = ops.decode_by_gather(q, k.float(), v.float(), bt, cl, head_dim**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("lens,hkv,group,head_dim,block_size", [c for c in CASES if c[3] % 16 == 0])
def test_decode_bf16_in_and_out_is_the_float_kernel_rounded(lens, hkv, group, head_dim, block_size):
    """bf16 queries (a strided view, as the model's qkv rows give them) over a bf16 cache take the bf16-in, bf16-out
    kernel, the native decode step's: each worker widens its sequences' q and rounds their outputs itself. Its
    answer is the float kernel's on the same values, rounded to bf16 (splits of one context and merges included)."""
    k, v, bt, cl = paged(
        lens, hkv, head_dim, block_size, torch.bfloat16, share=1 if len(lens) > 1 and min(lens) > 32 else 0
    )
    heads = hkv * group
    qkv = torch.randn(len(lens), heads + 2 * hkv, head_dim).bfloat16()
    q = qkv[:, :heads]
    out = native_attention.decode_attention(q, k, v, bt, cl, head_dim**-0.5)
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == q.shape
    as_float = native_attention.decode_attention(q.float(), k, v, bt, cl, head_dim**-0.5)
    assert torch.equal(out.view(torch.int16), as_float.bfloat16().view(torch.int16))


def test_decode_bf16_passes_answer_tiny_and_huge_scores():
    """Scores far apart (one token dominating) and a context of one token through the bf16 passes: the softmax's
    maximum and the masked lanes past the last token still hold."""
    k, v, bt, cl = paged([1, 9, 40], 3, 64, 16, torch.bfloat16)
    q = (torch.randn(3, 9, 64) * 30).bfloat16().float()
    out = native_attention.decode_attention(q, k, v, bt, cl, 0.125)
    ref = ops.decode_by_gather(q, k.float(), v.float(), bt, cl, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-4)


def test_decode_strided_query_and_bf16_query():
    k, v, bt, cl = paged([50, 9], 3, 64, 16)
    qkv = torch.randn(2, 9 + 6, 64)
    q = qkv[:, :9]  # a view into the fused qkv output, as the model passes it
    ref = ops.decode_by_gather(q.contiguous(), k, v, bt, cl, 0.125)
    torch.testing.assert_close(
        native_attention.decode_attention(q, k, v, bt, cl, 0.125), ref, atol=2e-6, rtol=2e-5
    )
    out16 = native_attention.decode_attention(q.bfloat16(), k, v, bt, cl, 0.125)
    assert out16.dtype == torch.bfloat16


def test_decode_declines_what_it_does_not_cover():
    k, v, bt, cl = paged([5], 2, 20, 16)  # head dim not a multiple of 8
    assert native_attention.decode_attention(torch.randn(1, 4, 20), k, v, bt, cl, 0.2) is None
    k, v, bt, cl = paged([5], 2, 16, 16, dtype=torch.float16)
    assert native_attention.decode_attention(torch.randn(1, 4, 16), k, v, bt, cl, 0.2) is None
    # the op itself still answers, through the gather path
    out = ops.paged_attention_decode(torch.randn(1, 4, 16, dtype=torch.float16), k, v, bt, cl, 0.25)
    assert out.shape == (1, 4, 16)


needs_f32_linear = pytest.mark.skipif(
    not cpu_native.f32_linear_available(), reason="the native float32 linear needs AVX-512 or AVX2 + FMA"
)
needs_avx2 = pytest.mark.skipif(
    not (native_build.available() and native_build.library().llmd_has_f32_linear_avx2()),
    reason="the AVX2 float32 linear needs AVX2 + FMA",
)


def f32_linear_via(kernel: str):
    """cpu_native.f32_linear through one named kernel: what this CPU runs, or the AVX2 one (which also runs on every
    AVX-512 CPU, so both kernels are checked wherever the project's machines have AVX-512)."""
    return lambda x, packed, b, n: cpu_native._packed_linear(kernel, x, packed, b, n)


KERNELS = [
    pytest.param("llmd_f32_linear", marks=needs_f32_linear, id="native"),
    pytest.param("llmd_f32_linear_avx2", marks=needs_avx2, id="avx2"),
]


@contextlib.contextmanager
def configured(configure, value: int, default: int):
    """A load-time kernel setting (llmd_*_configure) at `value` for the block, back to `default` after it."""
    assert configure(value) == value
    try:
        yield
    finally:
        configure(default)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 11, 12, 13, 25, 40, 1100])  # 1100: chunks of 512, 512, 76
@pytest.mark.parametrize("n", [70, 90])  # last tile: 6 channels (no second half), 26 (a partial second half)
@pytest.mark.parametrize("bias", [False, True])
def test_f32_linear_matches_torch(kernel, rows, n, bias):
    linear = f32_linear_via(kernel)
    g = torch.Generator().manual_seed(rows)
    k = 45  # an odd K
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = cpu_native.f32_pack(w)
    assert packed.numel() == 96 * k  # channels padded to whole tiles
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double() if bias else None)
    torch.testing.assert_close(linear(x, packed, b, n).double(), ref, atol=1e-4, rtol=1e-5)
    x3 = torch.randn(2, rows, 2 * k, generator=g)[..., :k]  # leading dims and a row stride
    out3 = linear(x3, packed, b, n)
    assert out3.shape == (2, rows, n)
    torch.testing.assert_close(out3, torch.nn.functional.linear(x3, w, b), atol=1e-4, rtol=1e-5)


@needs_f32_linear
def test_row_streams_follow_the_kernels_unless_set(monkeypatch):
    """One row's side-by-side tiles: 2 where the AVX-512 kernels run, 3 for the AVX2 ones (each measured best on its
    CPU kind), LLMDEPLOY_ROW_STREAMS first."""
    lib = native_build.library()
    monkeypatch.delenv(native_build.STREAMS_ENV, raising=False)
    expected = native_build.ROW_STREAMS_AVX512 if lib.llmd_has_avx512() else native_build.ROW_STREAMS_AVX2
    assert native_build.row_streams(lib) == expected
    monkeypatch.setenv(native_build.STREAMS_ENV, "1")
    assert native_build.row_streams(lib) == 1
    monkeypatch.setenv(native_build.STREAMS_ENV, "many")
    assert native_build.row_streams(lib) == expected  # a bad value keeps the default (and is logged)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("n", [32 * 7 - 5, 32 * 4, 32 * 9 + 3])  # 7, 4 and 10 tiles: groups of 3, 2 and 1
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("streams", [1, 2, 3])
def test_f32_linear_one_row_is_the_bits_of_a_batched_row(kernel, n, threads, streams, monkeypatch):
    """One row (decode at batch 1, bound by the weight stream) walks `streams` tiles at once
    (LLMDEPLOY_ROW_STREAMS); each output still sums over k in order, so a request alone gets the same bits as inside
    a batch."""
    linear, lib = f32_linear_via(kernel), native_build.library()
    g = torch.Generator().manual_seed(n)
    k = 77
    w, x, b = torch.randn(n, k, generator=g), torch.randn(2, k, generator=g), torch.randn(n, generator=g)
    packed = cpu_native.f32_pack(w)
    monkeypatch.setattr(native_build, "threads", lambda: threads)
    with configured(lib.llmd_row_streams_configure, streams, native_build.row_streams(lib)):
        one = linear(x[:1], packed, b, n)
    assert torch.equal(one, linear(x, packed, b, n)[:1])
    ref = torch.nn.functional.linear(x[:1].double(), w.double(), b.double())
    torch.testing.assert_close(one.double(), ref, atol=1e-4, rtol=1e-5)


@needs_avx2
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 7, 8, 12, 16, 17])  # blocks of 3 and 2; 17: past the side rows
@pytest.mark.parametrize("n", [32 * 7 - 5, 32 * 9 + 3])  # 7 and 10 tiles: groups of 3, 2 and 1
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("streams", [2, 3])
def test_avx2_small_batch_side_by_side_is_the_bits_of_the_tile_walk(rows, n, threads, streams, monkeypatch):
    """Up to llmd_side_rows rows (LLMDEPLOY_SIDE_ROWS) the AVX2 float32 linear reads `streams` tiles side by side in
    chunks of k, carrying each output's sum between chunks; it is the same bits as the one-tile walk (side rows 0),
    so a request's tokens do not depend on how many others share its step."""
    lib, linear = native_build.library(), f32_linear_via("llmd_f32_linear_avx2")
    g = torch.Generator().manual_seed(rows * n)
    k = 77  # chunks of 16 k-rows and a ragged last one
    w, x, b = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    packed = cpu_native.f32_pack(w)
    monkeypatch.setattr(native_build, "threads", lambda: threads)
    with configured(lib.llmd_row_streams_configure, streams, native_build.row_streams(lib)):
        side = linear(x, packed, b, n)
        with configured(lib.llmd_side_rows_configure, 0, native_build.SIDE_ROWS_DEFAULT):
            walk = linear(x, packed, b, n)
    assert torch.equal(side, walk)
    assert torch.equal(side[:1], linear(x[:1], packed, b, n))
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(side.double(), ref, atol=1e-4, rtol=1e-5)
    assert lib.llmd_side_rows_configure(99) == 16  # clamped to the accumulators it has room for
    lib.llmd_side_rows_configure(native_build.SIDE_ROWS_DEFAULT)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [3, 13, 25, 40, 64, 65])
def test_f32_linear_next_tile_prefetch_changes_no_bit(kernel, rows):
    """Up to llmd_tile_ahead_rows rows a tile's later walks prefetch the next tile (their own loop); the sums are
    the same bits with it off (LLMDEPLOY_TILE_AHEAD_ROWS=0) as on."""
    linear, lib = f32_linear_via(kernel), native_build.library()
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(200, 77, generator=g), torch.randn(rows, 77, generator=g)
    packed = cpu_native.f32_pack(w)
    assert lib.llmd_tile_ahead_configure(64) == 64
    on = linear(x, packed, None, 200)
    with configured(lib.llmd_tile_ahead_configure, 0, native_build.TILE_AHEAD_ROWS_DEFAULT):
        off = linear(x, packed, None, 200)
    assert torch.equal(on, off)
    torch.testing.assert_close(on.double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-5)


@needs_avx2
def test_avx2_linear_writes_only_its_outputs():
    """Rows past M and the padding channels of the last tile are never written (the engine hands out views)."""
    g = torch.Generator().manual_seed(1)
    n, k, rows = 40, 64, 7
    w, x = torch.randn(n, k, generator=g), torch.randn(rows + 2, k, generator=g)
    packed = cpu_native.f32_pack(w)
    lib = native_build.library()
    out = torch.full((rows + 2, n), 7.0)
    assert (
        lib.llmd_f32_linear_avx2(x.data_ptr(), k, packed.data_ptr(), None, out.data_ptr(), rows, n, k, 2) == 0
    )
    torch.testing.assert_close(out[:rows], x[:rows] @ w.T, atol=1e-4, rtol=1e-5)
    assert bool((out[rows:] == 7.0).all())


@needs_f32_linear
def test_packed_linear_runs_natively_and_unpacks_to_its_weight():
    from llmdeploy.engine.models.layers import PackedLinear

    lin = torch.nn.Linear(45, 70)
    packed = PackedLinear(lin.weight, lin.bias)
    assert packed.native is not None and packed.packed is None
    torch.testing.assert_close(packed.weight, lin.weight.detach())
    x = torch.randn(3, 45)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), lin(x), atol=1e-5, rtol=1e-5)


def test_packed_linear_without_any_packing_kernel_runs_its_weight(monkeypatch):
    """A dtype neither the native kernels nor oneDNN take on this CPU (bf16 on AVX2-only CPUs) keeps the dense
    weight and F.linear instead of failing at load."""
    from llmdeploy.engine.models import layers

    monkeypatch.setattr(layers, "onednn_linear_available", lambda dtype=torch.float32: False)
    monkeypatch.setattr(cpu_native, "native_pack", lambda weight: None)
    lin = torch.nn.Linear(45, 70).bfloat16()
    packed = layers.PackedLinear(lin.weight, lin.bias, register=False)
    assert packed.native is None and packed.packed is None and packed.weight is packed.dense
    x = torch.randn(3, 45).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), lin(x))


def layers_onednn_bf16() -> bool:
    from llmdeploy.engine.models.layers import onednn_linear_available

    return onednn_linear_available(torch.bfloat16)


needs_bf16_linear = pytest.mark.skipif(
    not cpu_native.bf16_linear_available(),
    reason="the native bfloat16 linear needs AVX-512 BF16 or AVX2 + FMA",
)


@needs_bf16_linear
@pytest.mark.parametrize("rows", [1, 2, 5, 11, 12, 13, 25, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_rounds_the_exact_sum_once(rows, bias):
    """float32 sums of bf16 products, rounded once to bf16: within one bf16 rounding of the exact result, the
    bound oneDNN's bf16 GEMM meets too."""
    g = torch.Generator().manual_seed(rows)
    n, k = 70, 46  # a channel tail in the last tile of 32; K even (pairs of inputs)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = cpu_native.bf16_pack(w)
    assert packed.dtype == torch.bfloat16 and packed.numel() == 96 * k
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double() if bias else None)
    out = cpu_native.bf16_linear(x, packed, b, n)
    assert out.dtype == torch.bfloat16
    one_rounding = exact.abs() * 2**-8 + 1e-6  # bf16 keeps 8 significant bits
    assert ((out.double() - exact).abs() <= one_rounding).all()
    x3 = torch.randn(2, rows, 2 * k, generator=g).bfloat16()[..., :k]  # leading dims and a row stride
    out3 = cpu_native.bf16_linear(x3, packed, b, n)
    assert out3.shape == (2, rows, n)
    torch.testing.assert_close(
        out3.reshape(-1, n), cpu_native.bf16_linear(x3.reshape(-1, k).contiguous(), packed, b, n)
    )


@needs_bf16_linear
@pytest.mark.parametrize("n", [32 * 7 - 5, 32 * 9 + 3, 32 * 23 + 5])  # 7, 10, 24 tiles, the last one partial
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("streams", [1, 2, 3])
def test_bf16_linear_one_row_is_the_bits_of_a_batched_row(n, threads, streams, monkeypatch):
    """As the float32 linears: one row walks `streams` runs of tiles at once (the partial last tile inside a run,
    or in the group of what is left over), each output's pairs still added in order."""
    lib, g = native_build.library(), torch.Generator().manual_seed(n)
    k = 78
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(2, k, generator=g).bfloat16()
    b, packed = torch.randn(n, generator=g).bfloat16(), cpu_native.bf16_pack(w)
    monkeypatch.setattr(native_build, "threads", lambda: threads)
    with configured(lib.llmd_row_streams_configure, streams, native_build.row_streams(lib)):
        one = cpu_native.bf16_linear(x[:1], packed, b, n)
    assert torch.equal(one, cpu_native.bf16_linear(x, packed, b, n)[:1])
    exact = torch.nn.functional.linear(x[:1].double(), w.double(), b.double())
    assert ((one.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()


def vdpbf16ps_steps(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w^T + b in vdpbf16ps's steps: each output from zero adds, input pair by pair, the odd input's product
    and then the even one's, rounding to float32 after each add (a bf16 product is exact in float32, so that is
    an FMA's rounding; float64 holds each sum exactly here), then + bias (0 without one), rounded to bf16."""
    xs, ws = x.double(), w.double()
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for p in range(x.shape[1] // 2):
        for j in (2 * p + 1, 2 * p):
            acc = (acc.double() + xs[:, j, None] * ws[None, :, j]).float()
    return (acc + (b.float() if b is not None else 0.0)).bfloat16()


needs_bf16_avx2 = pytest.mark.skipif(
    not (native_build.available() and native_build.library().llmd_has_bf16_linear_avx2()),
    reason="the AVX2 bf16 linear needs AVX2 + FMA",
)


@needs_bf16_avx2
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 12, 13, 17, 33])
@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize("side_rows", [0, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_avx2_bf16_linear_takes_vdpbf16ps_steps(rows, streams, side_rows, bias):
    """The AVX2 kernel widens the bf16 weights and keeps vdpbf16ps's arithmetic, bit for bit, at every row count
    and walk (one row's side-by-side tiles, small batches' chunks of side-by-side tiles, whole widened tiles);
    7 and 10 tiles split between 2 threads give groups of 3, 2 and 1, K = 78 a last chunk of 14 inputs."""
    lib, g = native_build.library(), torch.Generator().manual_seed(rows * 10 + streams)
    k = 78
    for n in (32 * 7 - 5, 32 * 9 + 3):
        w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()
        b = torch.randn(n, generator=g).bfloat16() if bias else None
        with (
            configured(lib.llmd_row_streams_configure, streams, native_build.row_streams(lib)),
            configured(lib.llmd_side_rows_configure, side_rows, native_build.SIDE_ROWS_DEFAULT),
        ):
            out = cpu_native._packed_linear("llmd_bf16_linear_avx2", x, cpu_native.bf16_pack(w), b, n)
        assert torch.equal(out.view(torch.int16), vdpbf16ps_steps(x, w, b).view(torch.int16))


@needs_bf16_linear
def test_bf16_linear_declines_what_it_does_not_cover():
    w = torch.randn(8, 5).bfloat16()
    assert cpu_native.bf16_pack(w) is None  # odd K: no pairs
    assert cpu_native.bf16_pack(w.float()) is None
    packed = cpu_native.bf16_pack(torch.randn(8, 6).bfloat16())
    assert cpu_native.bf16_linear(torch.randn(2, 6), packed, None, 8) is None  # float32 rows


@needs_bf16_linear
@pytest.mark.parametrize(
    "amx",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not layers_onednn_bf16(), reason="oneDNN packs bf16 only on AVX-512 or AVX-NE-CONVERT CPUs"
            ),
        ),
    ],
)
def test_packed_bf16_linear_unpacks_and_matches_onednn(amx):
    """Without AMX one native copy runs every row count; with AMX oneDNN's copy takes the rows past
    BF16_NATIVE_MAX_ROWS_WITH_AMX (or _WITHOUT_AMX_TILES). Both agree with torch's bf16 linear to one bf16
    rounding."""
    from llmdeploy.engine.models import layers

    lin = torch.nn.Linear(46, 70).bfloat16()
    packed = layers.PackedLinear(lin.weight, lin.bias, amx=amx, register=False)
    assert packed.native is not None and (packed.packed is not None) == amx
    torch.testing.assert_close(packed.weight, lin.weight.detach(), atol=0, rtol=0)
    for rows in (1, layers.BF16_NATIVE_MAX_ROWS_WITH_AMX + 1, 64):
        x = torch.randn(rows, 46).bfloat16()
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), lin(x), atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def build_for(tmp_path_factory):
    """The kernels built for another x86 target (-march=...), once per module (a build takes 5-10 s at -O1)."""

    @functools.cache
    def build(march: str):
        return native_build.load(
            native_build.build(quick_flags(march), tmp_path_factory.mktemp(f"build-{march}"))
        )

    return build


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
def test_portable_build_without_avx2_agrees(build_for, monkeypatch):
    """The plain-C lanes (no AVX2 intrinsics), built here with a baseline x86-64 target, give the same results."""
    torch.manual_seed(0)
    k, v, bt, cl = paged([33, 300], 3, 64, 16)
    q, w, x = torch.randn(2, 9, 64), quantize_q8(torch.randn(9, 64)), torch.randn(3, 64)
    ref = native_attention.decode_attention(q, k, v, bt, cl, 0.125)
    lib = build_for("x86-64")
    assert lib.llmd_has_avx2() == 0 and lib.llmd_has_avx512() == 0
    monkeypatch.setattr(native_build, "library", lambda: lib)
    torch.testing.assert_close(
        native_attention.decode_attention(q, k, v, bt, cl, 0.125), ref, atol=2e-6, rtol=2e-5
    )
    kb, vb, btb, _ = paged([40], 3, 64, 16, torch.bfloat16)
    assert (
        native_attention.prefill_attention(q[:1].bfloat16(), kb, vb, btb[0], 40, 0.125) is None
    )  # AVX-512 BF16 only
    kf, vf, btf, _ = paged([40], 3, 64, 16)
    assert native_attention.prefill_attention(q[:1], kf, vf, btf[0], 40, 0.125) is None  # AVX2 + FMA only
    assert not native_quant.q_vnni_available()  # the block-quantized linear: its float32 kernel
    lin = native_quant.q_linear(x, native_quant.q_pack(w.fmt, w.q, w.d, None), None)
    torch.testing.assert_close(lin, torch.nn.functional.linear(x, w.dequantize()), atol=1e-5, rtol=1e-5)
    # no AVX2 nor AVX-512: the float32 layers keep oneDNN's packed GEMM
    from llmdeploy.engine.models.layers import PackedLinear, onednn_linear_available

    assert not cpu_native.f32_linear_available() and cpu_native.f32_pack(torch.ones(4, 4)) is None
    assert (
        not cpu_native.bf16_linear_available() and cpu_native.bf16_pack(torch.ones(4, 4).bfloat16()) is None
    )
    if torch.backends.mkldnn.is_available():
        layer = torch.nn.Linear(64, 9)
        packed = PackedLinear(layer.weight, layer.bias)
        assert packed.native is None
        torch.testing.assert_close(packed(x), layer(x), atol=1e-5, rtol=1e-5)
    if onednn_linear_available(torch.bfloat16):  # oneDNN packs bf16 only on AVX-512 or AVX-NE-CONVERT CPUs
        layer = torch.nn.Linear(64, 9).bfloat16()
        packed = PackedLinear(layer.weight, layer.bias, register=False)
        assert packed.native is None and packed.packed is not None
        torch.testing.assert_close(packed(x.bfloat16()), layer(x.bfloat16()), atol=2e-2, rtol=2e-2)


def test_switched_off_falls_back(monkeypatch):
    monkeypatch.setenv(native_build.ENV_SWITCH, "0")
    monkeypatch.setattr(native_build, "library", native_build.library.__wrapped__)
    assert native_build.library() is None
    k, v, bt, cl = paged([20], 1, 16, 16)
    assert native_attention.decode_attention(torch.randn(1, 2, 16), k, v, bt, cl, 0.25) is None
    assert ops.paged_attention_decode(torch.randn(1, 2, 16), k, v, bt, cl, 0.25).shape == (1, 2, 16)


def test_build_is_cached_and_reports_compiler_errors(tmp_path, monkeypatch):
    # what is tested is the cache and the errors: the quickest build (3 s)
    flags = quick_flags("x86-64", "-O0")
    first = native_build.build(flags, tmp_path)
    assert native_build.build(flags, tmp_path) == first  # keyed: the second call compiles nothing
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind
    with pytest.raises(native_build.NativeBuildError, match="failed"):
        native_build.build(("-fno-such-flag-at-all",), tmp_path)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises((native_build.NativeBuildError, OSError)):
        native_build.build(flags, tmp_path / "other")


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(rows, with_residual):
    x, r, w = torch.randn(rows, 64), torch.randn(rows, 64), torch.randn(64)
    residual = r if with_residual else None
    out, summed = cpu_native.add_rms_norm(x, w, 1e-5, residual)
    ref_sum = x + r if with_residual else x
    torch.testing.assert_close(summed, ref_sum, atol=0, rtol=0)  # the residual stream is exact
    ref = torch.nn.functional.rms_norm(ref_sum, (64,), w, 1e-5)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)
    assert cpu_native.add_rms_norm(x.bfloat16(), w, 1e-5, None) is None  # dtypes must agree


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_bf16_rounds_where_torch_does(rows, with_residual):
    """bf16: x + residual rounded, normalised in float32 and rounded, times the weight and rounded, as the torch
    path (kernels/reference.py) computes it: equal but for a last-bit tie in the sum of squares' order."""
    torch.manual_seed(rows)
    x, r, w = torch.randn(rows, 64).bfloat16(), torch.randn(rows, 64).bfloat16(), torch.randn(64).bfloat16()
    residual = r if with_residual else None
    out, summed = cpu_native.add_rms_norm(x, w, 1e-5, residual)
    assert out.dtype == summed.dtype == torch.bfloat16
    ref_sum = x + r if with_residual else x
    torch.testing.assert_close(summed, ref_sum, atol=0, rtol=0)
    ref = torch.nn.functional.rms_norm(ref_sum.float(), (64,), None, 1e-5).bfloat16() * w
    torch.testing.assert_close(out, ref, atol=0, rtol=2**-7)  # at most one bf16 step apart
    assert (out == ref).float().mean() > 0.97


@pytest.mark.parametrize("inter", [48, 40])  # 40: 16-lane passes then an 8-lane one
@pytest.mark.parametrize("rows", [1, 33])
def test_silu_and_mul_matches_torch(rows, inter):
    x = torch.randn(rows, 2 * inter) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(
        cpu_native.silu_and_mul(x), torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=2e-6
    )


@pytest.mark.parametrize("inter", [1536, 40])
@pytest.mark.parametrize("rows", [1, 33])
def test_bf16_silu_and_mul_rounds_as_torch(rows, inter):
    """Where the library has AVX-512 the layers take bf16 silu * up from it: torch's F.silu(gate).mul_(up) in bf16,
    silu rounded to bf16, then the product; the same bits but where the two exps' last float32 bits round apart.
    The 8-lane pass (the decode step's on AVX2, and the tail here) gives the 16-lane one's bits."""
    x = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 4).bfloat16()
    gate, up = x.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate).mul_(up)
    out = cpu_native.silu_and_mul(x)
    if not native_build.library().llmd_has_avx512():
        assert out is None  # torch's ops stay
        return
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=0, rtol=2**-7)  # at most one bf16 step apart
    assert (out == ref).float().mean() > 0.99
    eight = torch.empty_like(out)  # the 8-lane pass alone: rows of 8 values
    lib = native_build.library()
    g8 = torch.cat([gate.reshape(-1, 8), up.reshape(-1, 8)], dim=1).contiguous()
    assert lib.llmd_silu_mul_bf16(g8.data_ptr(), eight.data_ptr(), g8.shape[0], 8, 1) == 0
    assert torch.equal(eight.view(torch.int16), out.view(torch.int16))


@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_store_matches_torch(tokens, dtype):
    h, hkv, d, block = 4, 2, 32, 16
    cache_shape = (6, block, hkv, d)
    k_cache, v_cache = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)
    qkv = torch.randn(tokens, h + 2 * hkv, d).to(dtype)
    positions = torch.randint(0, 500, (tokens,))
    angles = positions[:, None].float() * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None]
    table = torch.zeros(512, d)
    table[positions] = torch.cat((angles.cos(), angles.sin()), dim=-1)
    cos, sin = ops.rotary_tables(positions, table)
    slots = torch.randperm(6 * block)[:tokens]
    slots[0] = -1  # a padding row: rotated, not stored
    expect_q, expect_k = ops.rotary_embedding(
        positions, qkv[:, :h].clone(), qkv[:, h : h + hkv].clone(), table
    )
    expect_v = qkv[:, h + hkv :].clone()
    assert cpu_native.rope_and_store(qkv, h, hkv, cos, sin, slots, k_cache, v_cache)
    torch.testing.assert_close(qkv[:, :h], expect_q, atol=0, rtol=0)  # same two products and a sum
    torch.testing.assert_close(qkv[:, h : h + hkv], expect_k, atol=0, rtol=0)
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    stored = slots >= 0
    torch.testing.assert_close(flat_k[slots[stored]], expect_k[stored])
    torch.testing.assert_close(flat_v[slots[stored]], expect_v[stored])
    assert int((flat_k != 0).any(-1).any(-1).sum()) == int(stored.sum())


def argmax_cases() -> list[torch.Tensor]:
    """Logit rows where argmax's rules matter: ties (the first wins), NaN (wins, the first one), -inf, +inf,
    row lengths around the 16-lane chunks, and a winner in the tail past the last whole chunk."""
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(37, 49152, generator=g)
    ties = torch.zeros(3, 100)
    ties[0, [7, 40, 99]] = 1.0  # several equal maxima, in different lanes and chunks
    ties[1, [33, 17]] = 2.0  # the later chunk's lane first in index order
    nans = torch.randn(6, 70, generator=g)
    nans[0, 3] = float("nan")  # in the first chunk
    nans[1, [50, 20]] = float("nan")  # two: the first wins
    nans[2, 66] = float("nan")  # in the tail
    nans[3, :] = float("nan")
    nans[4, 10] = float("inf")
    nans[4, 60] = float("nan")  # NaN beats +inf
    nans[5, :] = float("-inf")
    tail = torch.full((2, 35), -1.0)
    tail[0, 34] = 5.0
    tail[1, [31, 33]] = 5.0
    short = torch.randn(4, 5, generator=g)
    return [rand, ties, nans, tail, short, torch.tensor([[-0.0, 0.0, -0.0]]), rand[:5, 3:1003]]


def test_argmax_rows_answers_as_torch_does():
    for logits in argmax_cases():
        assert cpu_native.argmax_rows(logits) == logits.argmax(-1).tolist()
    assert cpu_native.argmax_rows(torch.zeros(0, 8)) == []
    assert cpu_native.argmax_rows(torch.zeros(2, 8).t()) is None  # columns not contiguous
    assert cpu_native.argmax_rows(torch.zeros(2, 8, dtype=torch.bfloat16)) is None
    assert (
        cpu_native.argmax_rows(torch.zeros(8)) is None and cpu_native.argmax_rows(torch.zeros(2, 0)) is None
    )


def check_sample_rows() -> None:
    """cpu_native.sample_rows against the sampler's definition: inverse CDF of softmax(x / T) in token order, min_p
    of the best token's probability, NaN as -inf and +inf as the largest float, rows with no finite logit refused."""
    # weights 1, 1, 2 (and masked tokens): cumulative 1, 2, 4 of 4; uniforms away from the edges
    row = [0.0, float("-inf"), 0.0, float("nan"), math.log(2.0)] + [
        float("-inf")
    ] * 12  # 16 in lanes, 1 after
    picks = torch.tensor([row]).expand(5, 17).contiguous()
    u = [0.0, 0.2, 0.3, 0.6, 1 - 2**-24]
    assert cpu_native.sample_rows(picks, [1.0] * 5, [0.0] * 5, u) == [0, 0, 2, 4, 4]
    assert cpu_native.sample_rows(picks, [1.0] * 5, [0.75] * 5, u) == [4] * 5  # min_p 0.75 of weight 2: alone
    inf = torch.tensor([[3.0, float("inf"), 5.0, float("inf")]])
    assert cpu_native.sample_rows(inf, [1.0], [0.0], [0.9]) == [3]  # the two +inf share the mass
    for empty in (torch.full((1, 40), float("-inf")), torch.full((1, 40), float("nan"))):
        assert cpu_native.sample_rows(empty, [1.0], [0.0], [0.5]) is None
    # stratified uniforms: each token's share of 4000 draws is its probability to 1 / 4000
    n = 4000
    u = [(i + 0.5) / n for i in range(n)]
    probs = torch.tensor(
        [0.3, 0.02, 0.15, 0.05, 0.01, 0.2, 0.04, 0.03, 0.1, 0.06, 0.04]
    )  # 8 in lanes, 3 after
    for inv_t, min_p in ((1.0, 0.0), (0.5, 0.0), (2.0, 0.0), (1.0, 0.25), (0.5, 0.3)):
        logits = (
            (probs.log() * 7.0 + 3.0).expand(n, 11).contiguous()
        )  # any scale and shift: the temperature's
        want = (probs.log() * 7.0 * inv_t).softmax(-1)
        want = want.masked_fill(want < min_p * want.max(), 0.0)
        want /= want.sum()
        tokens = cpu_native.sample_rows(logits, [inv_t] * n, [min_p] * n, u)
        got = torch.bincount(torch.tensor(tokens), minlength=11).double() / n
        assert torch.allclose(got, want.double(), atol=1.5 / n), (inv_t, min_p, got, want)
    # a vocabulary's width, rows in both threads: the draw lands where the cumulative softmax says
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(9, 50_003, generator=g) * 3
    u = torch.rand(9, generator=g, dtype=torch.float64).tolist()
    cdf = (wide * 1.25).double().softmax(-1).cumsum(-1)
    for r, t in enumerate(cpu_native.sample_rows(wide, [1.25] * 9, [0.0] * 9, u)):
        below = float(cdf[r, t - 1]) if t else 0.0  # the float32 weights' sums: within 1e-6 of float64's
        assert below - 1e-6 <= u[r] <= float(cdf[r, t]) + 1e-6, (r, t, u[r])


def test_sample_rows_draws_by_inverse_cdf_in_token_order():
    check_sample_rows()
    assert cpu_native.sample_rows(torch.zeros(2, 8).t(), [1.0] * 8, [0.0] * 8, [0.5] * 8) is None
    assert cpu_native.sample_rows(torch.zeros(2, 8), [1.0], [0.0], [0.5]) is None  # one setting for two rows


def avx2_cpu() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return all(f" {f}" in flags for f in ("avx2", "fma", "f16c"))


MARCHES = [
    pytest.param("x86-64", id="portable"),
    # the AVX2 build of an AVX-512 machine's kernels: its AVX2 paths are checked on every machine with AVX2
    pytest.param(
        "haswell", id="avx2", marks=pytest.mark.skipif(not avx2_cpu(), reason="needs AVX2 + FMA + F16C")
    ),
]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets")
@pytest.mark.parametrize("march", MARCHES)
def test_argmax_rows_other_builds_agree(march, build_for, monkeypatch):
    lib = build_for(march)
    assert lib.llmd_has_avx512() == 0 and lib.llmd_has_f32_linear() == (march == "haswell")
    monkeypatch.setattr(native_build, "library", lambda: lib)
    for logits in argmax_cases():
        assert cpu_native.argmax_rows(logits) == logits.argmax(-1).tolist()
    check_sample_rows()  # its scalar path (portable) and its 8-lane one (AVX2)
    if march == "haswell":  # llmd_f32_linear dispatches to the AVX2 kernel in that build
        w, x = torch.randn(70, 45), torch.randn(13, 45)
        torch.testing.assert_close(cpu_native.f32_linear(x, cpu_native.f32_pack(w), None, 70), x @ w.T)
        # llmd_bf16_linear dispatches to the AVX2 kernel there too
        wb, xb = torch.randn(70, 46).bfloat16(), torch.randn(13, 46).bfloat16()
        out = cpu_native.bf16_linear(xb, cpu_native.bf16_pack(wb), None, 70)
        assert torch.equal(out.view(torch.int16), vdpbf16ps_steps(xb, wb, None).view(torch.int16))
