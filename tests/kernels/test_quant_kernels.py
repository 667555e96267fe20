"""The block-quantized linear kernels (q_linear.c q_linear / qv_linear, linear_avx512.c q_bf16_linear) against their
definitions: the float32 kernel equals x @ dequantized(w)^T up to summation order; from Q_BF16_MIN_ROWS rows the
same layout runs as bf16(x) @ bf16(dequantized w)^T; the VNNI kernel equals the same product with x rounded
to int8 per block of 32 (as llama.cpp computes it), which this file computes exactly in float64. Q8 and Q4 blocks,
channel tails, bias, leading dims and row strides, every row-block size; the layer's padding of a K that is not a
multiple of 32; what the kernels decline."""

from __future__ import annotations

import pytest
import torch

from llmdeploy.engine.models.quant import BlockWeights, QuantLinear, quantize_q8
from llmdeploy.kernels import cpu_native, native_build, native_quant
from llmdeploy.kernels.native_quant import Q_BLOCK, QFormat

pytestmark = [
    pytest.mark.skipif(not native_build.available(), reason="native CPU kernels do not build here"),
    pytest.mark.usefixtures("two_threads"),
]
needs_vnni = pytest.mark.skipif(
    not native_quant.q_vnni_available(), reason="the VNNI kernel needs AVX-512 VNNI"
)
ROWS = [1, 2, 5, 6, 7, 13, 40]  # 6 rows per register block: every tail size


def random_blocks(fmt: QFormat, n: int, k: int, seed: int = 0) -> BlockWeights:
    g = torch.Generator().manual_seed(seed)
    if fmt == QFormat.Q8:
        return quantize_q8(torch.randn(n, k, generator=g))
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // Q_BLOCK, generator=g) / 8).half()
    m = (-torch.rand(n, k // Q_BLOCK, generator=g)).half()
    return BlockWeights(QFormat.Q4, q, d, m, k)


def int8_rounded_product(x: torch.Tensor, w: BlockWeights) -> torch.Tensor:
    """x @ w^T in float64 with x rounded to int8 per block as the VNNI kernel rounds it: dx = amax / 127,
    xq = round-half-even(x * (127 / amax)) (both in float32)."""
    rows, k = x.shape
    xb = x.view(rows, -1, Q_BLOCK)
    amax = xb.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv[..., None]).double()
    dx = (amax / 127.0).double()
    q = w.q.double().view(w.out_features, -1, Q_BLOCK)
    dots = torch.einsum("rbk,nbk->rnb", xq, q)  # exact: integer sums
    out = dots * w.d.double()[None] * dx[:, None, :]
    if w.m is not None:
        out = out + w.m.double()[None] * (dx * xq.sum(-1))[:, None, :]
    return out.sum(-1)


@pytest.mark.parametrize("fmt", list(QFormat))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_float_kernel_equals_the_dequantized_product(fmt, rows, bias, monkeypatch):
    monkeypatch.setattr(native_quant, "Q_BF16_MIN_ROWS", 10**9)  # the float32 kernel at every row count
    n, k = 70, 96  # a channel tail in the last tile of 32, three blocks
    w = random_blocks(fmt, n, k, seed=rows)
    b = torch.randn(n) if bias else None
    packed = native_quant.q_pack(fmt, w.q, w.d, w.m, vnni=False)
    assert packed is not None and packed.data.numel() == native_quant.q_packed_bytes(fmt, n, k)
    x = torch.randn(rows, k)
    ref = torch.nn.functional.linear(x.double(), w.dequantize().double(), None if b is None else b.double())
    torch.testing.assert_close(native_quant.q_linear(x, packed, b).double(), ref, atol=1e-4, rtol=1e-5)


needs_avx2 = pytest.mark.skipif(
    not (native_build.available() and native_build.library().llmd_has_q_linear_avx2()),
    reason="the AVX2 kernel needs AVX2 + FMA + F16C",
)


@needs_avx2
@pytest.mark.parametrize("fmt", list(QFormat))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", [70, 90])  # last tile: 6 channels (no second half), 26 (a partial second half)
@pytest.mark.parametrize("bias", [False, True])
def test_avx2_kernel_equals_the_dequantized_product(fmt, rows, n, bias):
    """The AVX2 kernel (what llmd_q_linear runs on AVX2 CPUs without AVX-512), called directly so AVX-512 machines
    check it too: x @ dequantized(w)^T, leading dims and a row stride; nothing written past the outputs."""
    k = 96
    w = random_blocks(fmt, n, k, seed=rows + n)
    b = torch.randn(n) if bias else None
    packed = native_quant.q_pack(fmt, w.q, w.d, w.m, vnni=False)
    x = torch.randn(2, rows, 2 * k)[..., :k]
    out = torch.full((2 * rows + 1, n), 7.0)
    rc = native_build.library().llmd_q_linear_avx2(
        int(fmt),
        x.data_ptr(),
        x.stride(1),
        packed.data.data_ptr(),
        None if b is None else b.data_ptr(),
        out.data_ptr(),
        rows,
        n,
        k,
        2,
    )
    assert rc == 0
    ref = torch.nn.functional.linear(
        x[0].double(), w.dequantize().double(), None if b is None else b.double()
    )
    torch.testing.assert_close(out[:rows].double(), ref, atol=1e-4, rtol=1e-5)
    assert bool((out[rows:] == 7.0).all())


needs_bf16 = pytest.mark.skipif(
    not cpu_native.avx512_bf16_available(), reason="the many-row kernel needs AVX-512 BF16"
)


@needs_bf16
@pytest.mark.parametrize("fmt", list(QFormat))
@pytest.mark.parametrize("rows", [1, 11, 12, 13, 40])  # 12 rows per register block of the bf16 kernel
@pytest.mark.parametrize("bias", [False, True])
def test_many_rows_run_bf16_products_of_the_dequantized_weight(fmt, rows, bias, monkeypatch):
    """From Q_BF16_MIN_ROWS rows the float layout runs as bf16(x) @ bf16(dequantized w)^T with float32 sums."""
    monkeypatch.setattr(native_quant, "Q_BF16_MIN_ROWS", 1)
    n, k = 70, 96
    w = random_blocks(fmt, n, k, seed=200 + rows)
    b = torch.randn(n) if bias else None
    packed = native_quant.q_pack(fmt, w.q, w.d, w.m, vnni=False)
    x = torch.randn(rows, k)
    out = native_quant.q_linear(x, packed, b)
    wb = w.dequantize().bfloat16().double()
    ref = torch.nn.functional.linear(x.bfloat16().double(), wb, None if b is None else b.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)


@needs_bf16
def test_the_row_count_picks_the_kernel():
    """Below Q_BF16_MIN_ROWS the exact weights meet float32 rows; from there bf16 ones (decode stays exact)."""
    w = random_blocks(QFormat.Q8, 64, 64, seed=7)
    packed = native_quant.q_pack(w.fmt, w.q, w.d, None, vnni=False)
    exact_w, bf16_w = w.dequantize().double(), w.dequantize().bfloat16().double()
    for rows in (native_quant.Q_BF16_MIN_ROWS - 1, native_quant.Q_BF16_MIN_ROWS):
        x = torch.randn(rows, 64)
        out = native_quant.q_linear(x, packed, None).double()
        exact = x.double() @ exact_w.T
        rounded = x.bfloat16().double() @ bf16_w.T
        near, far = (exact, rounded) if rows < native_quant.Q_BF16_MIN_ROWS else (rounded, exact)
        assert (out - near).abs().max() < 1e-4 < (out - far).abs().max()


def test_int8_layers_are_weight_only():
    """model.quantization int8 packs the float layout: the layers' inputs are never rounded to int8."""
    layer = QuantLinear(quantize_q8(torch.randn(32, 64)), None, int8_inputs=False)
    assert layer.packed is not None and not layer.packed.vnni


@needs_vnni
@pytest.mark.parametrize("fmt", list(QFormat))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_vnni_kernel_equals_the_int8_rounded_product(fmt, rows, bias):
    n, k = 70, 96
    w = random_blocks(fmt, n, k, seed=100 + rows)
    if fmt == QFormat.Q8:
        w.q[:2, :10] = -128  # GGUF files may hold it; quantize_q8 does not make it
    b = torch.randn(n) if bias else None
    packed = native_quant.q_pack(fmt, w.q, w.d, w.m, vnni=True)
    assert packed is not None and packed.vnni
    x = torch.randn(rows, k)
    x[0, :Q_BLOCK] = 0.0  # a block of zeros: no scale to divide by
    out = native_quant.q_linear(x, packed, b)
    if 0 < native_quant.qv_exact_min_rows() <= rows:  # AVX2 prefill: float32 rows, the float layout's bits
        floats = native_quant.q_pack(fmt, w.q, w.d, w.m, vnni=False)
        assert torch.equal(out, native_quant.q_linear(x, floats, b))
        return
    ref = int8_rounded_product(x, w) + (0.0 if b is None else b.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)
    exact = torch.nn.functional.linear(x.double(), w.dequantize().double(), None if b is None else b.double())
    assert float((out.double() - exact).norm() / exact.norm()) < 0.02  # what rounding x to int8 costs


def rounded_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x's int8 quants, scales and quant sums per block, in float32 steps as the kernels compute them."""
    xb = x.view(x.shape[0], -1, Q_BLOCK)
    amax = xb.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv[..., None])
    return xq, amax / 127.0, xq.sum(-1)


@pytest.mark.skipif(
    native_quant.qv_exact_min_rows() == 0, reason="another kernel runs the int8 products in this build"
)
@pytest.mark.parametrize("fmt", list(QFormat))
def test_avx2_int8_products_are_the_vnni_kernels_float_steps(fmt):
    """Below qv_exact_min_rows rows the AVX2 kernel sums each block's integer products exactly and adds them into
    float32 sums in the AVX-512 VNNI kernel's steps: per block in order one fused multiply-add of the sum by
    d * dx (rounded to float32), Q4 then one of dx * sum(xq) by m, then + bias; modelled here in float64 (exact
    products, the sums rounded to float32). A Q8 quant of -128, which GGUF files may hold, is exact too."""
    rows, n, k = native_quant.qv_exact_min_rows() - 1, 70, 160
    w, b = random_blocks(fmt, n, k, seed=11), torch.randn(n)
    if fmt == QFormat.Q8:
        w.q[:3, :40] = -128
    x = torch.randn(rows, k) * 4
    out = native_quant.q_linear(x, native_quant.q_pack(fmt, w.q, w.d, w.m, vnni=True), b)
    xq, dx, xqsum = rounded_x(x)
    q = w.q.to(torch.int64).view(n, -1, Q_BLOCK)
    sums = torch.einsum("rbk,nbk->rnb", xq.to(torch.int64), q)  # exact
    acc = torch.zeros(rows, n)
    for blk in range(k // Q_BLOCK):
        scale = w.d[:, blk].float()[None] * dx[:, blk, None]  # float32 product
        acc = (sums[:, :, blk].double() * scale.double() + acc.double()).float()
        if w.m is not None:
            mx = dx[:, blk] * xqsum[:, blk]
            acc = (mx.double()[:, None] * w.m[:, blk].double()[None] + acc.double()).float()
    assert torch.equal(out, acc + b)


@pytest.mark.skipif(not native_quant.q_vnni_available(), reason="no kernel for the int8 products here")
@pytest.mark.parametrize("fmt", list(QFormat))
def test_int8_products_give_a_row_the_same_bits_in_any_batch(fmt):
    """A row's output does not depend on the rows beside it nor on how many weight tiles a thread reads side by
    side (LLMDEPLOY_ROW_STREAMS), below and across qv_exact_min_rows."""
    lib, n, k = native_build.library(), 32 * 7 + 5, 96  # 8 tiles: groups of 3, 2 and 1 a thread
    w = random_blocks(fmt, n, k, seed=5)
    packed = native_quant.q_pack(fmt, w.q, w.d, w.m, vnni=True)
    most = native_quant.qv_exact_min_rows() - 1 if native_quant.qv_exact_min_rows() else 19
    x = torch.randn(most, k)
    alone = torch.cat([native_quant.q_linear(x[i : i + 1], packed, None) for i in range(most)])
    for streams in (1, 2, 3):
        assert lib.llmd_row_streams_configure(streams) == streams
        try:
            for rows in (1, 2, 3, 5, most):
                assert torch.equal(native_quant.q_linear(x[:rows], packed, None), alone[:rows])
        finally:
            lib.llmd_row_streams_configure(native_build.row_streams(lib))


@pytest.mark.parametrize("vnni", [False, pytest.param(True, marks=needs_vnni)])
def test_leading_dims_and_row_strides(vnni):
    w = random_blocks(QFormat.Q4, 40, 64, seed=3)
    packed = native_quant.q_pack(w.fmt, w.q, w.d, w.m, vnni=vnni)
    x = torch.randn(2, 3, 128)[..., :64]  # rows with a stride of 128
    out = native_quant.q_linear(x, packed, None)
    assert out.shape == (2, 3, 40)
    torch.testing.assert_close(
        out.reshape(6, 40), native_quant.q_linear(x.reshape(6, 64).contiguous(), packed, None)
    )


def test_layer_pads_k_to_whole_blocks():
    torch.manual_seed(0)
    w, b = torch.randn(33, 48), torch.randn(33)  # K = 48: one and a half blocks
    layer = QuantLinear(quantize_q8(w), b)
    assert layer.padded_in == 64 and layer.weight.shape == (33, 48)
    x = torch.randn(5, 48)
    ref = torch.nn.functional.linear(x.double(), layer.weight.double(), b.double())
    rel = float((layer(x).double() - ref).norm() / ref.norm())
    assert rel < 0.02
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_what_the_kernels_decline():
    w = random_blocks(QFormat.Q8, 8, 64)
    assert native_quant.q_pack(QFormat.Q8, w.q[:, :48], w.d[:, :1], None) is None  # K not whole blocks
    assert native_quant.q_pack(QFormat.Q8, w.q, w.d.float(), None) is None  # scales must be float16
    assert native_quant.q_pack(QFormat.Q4, w.q, w.d, None) is None  # Q4 needs its minimums
    packed = native_quant.q_pack(QFormat.Q8, w.q, w.d, None)
    assert native_quant.q_linear(torch.randn(2, 64).double(), packed, None) is None  # float32 rows only
    assert native_quant.q_linear(torch.randn(2, 32), packed, None) is None  # another K


@pytest.mark.parametrize("fmt", list(QFormat))
@pytest.mark.parametrize("vnni", [False, True])
def test_unpack_gives_the_dequantized_weight_back(fmt, vnni):
    w = random_blocks(fmt, 70, 96, seed=7)
    packed = native_quant.q_pack(fmt, w.q, w.d, w.m, vnni=vnni)  # either layout packs on any CPU
    torch.testing.assert_close(native_quant.q_unpack(packed), w.dequantize(), atol=0, rtol=0)
    layer = QuantLinear(w, None)
    assert layer.blocks is None  # packed: the layer keeps no second copy
    torch.testing.assert_close(layer.weight, w.dequantize(), atol=0, rtol=0)
