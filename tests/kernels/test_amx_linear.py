"""The bf16 linear on AMX tiles (kernels/csrc/amx_linear.c): same packed weights as the vdpbf16ps kernel, same
one-rounding bound, every row-count tail and block boundary, and the switch that turns it off."""

from __future__ import annotations

import pytest
import torch

from llmdeploy.kernels import cpu_native, native_build

needs_amx = pytest.mark.skipif(
    not cpu_native.bf16_linear_available() or not native_build.amx_can_run(),
    reason="the AMX linear needs AMX-BF16 (and Linux granting its tile state)",
)


@pytest.fixture
def amx_from(monkeypatch):
    """Sets the AMX row threshold for one test and puts the default back after it."""

    def set_rows(rows: int) -> int:
        monkeypatch.setenv(native_build.AMX_ENV, str(rows))
        return native_build.amx_linear_rows()

    yield set_rows
    monkeypatch.delenv(native_build.AMX_ENV, raising=False)
    native_build.amx_linear_rows()


@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 31, 32, 33, 48, 255, 256, 257, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_rounds_the_exact_sum_once(rows, bias, amx_from):
    assert amx_from(1) == 1
    g = torch.Generator().manual_seed(rows)
    n, k = 70, 96  # a channel tail in the last tile of 32; K a multiple of the tile's 32 inputs
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = cpu_native.bf16_pack(w)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double() if bias else None)
    out = cpu_native.bf16_linear(x, packed, b, n)
    one_rounding = exact.abs() * 2**-8 + 1e-6
    assert ((out.double() - exact).abs() <= one_rounding).all()
    strided = torch.randn(rows, 2 * k, generator=g).bfloat16()[:, :k]  # a row stride the tile loads follow
    torch.testing.assert_close(
        cpu_native.bf16_linear(strided, packed, b, n),
        cpu_native.bf16_linear(strided.contiguous(), packed, b, n),
        atol=0,
        rtol=0,
    )


@needs_amx
def test_amx_and_vdpbf16ps_agree_and_the_switch_turns_amx_off(amx_from):
    """Both kernels round the same float32 sums (in another order) once: within one bf16 step of each other. With
    the threshold at 0 the library reports AMX off and a layer hands oneDNN its rows past vdpbf16ps's few."""
    from llmdeploy.engine.models import layers

    g = torch.Generator().manual_seed(0)
    n, k = 200, 576
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(40, k, generator=g).bfloat16()
    packed = cpu_native.bf16_pack(w)
    assert amx_from(1) == 1
    on_amx = cpu_native.bf16_linear(x, packed, None, n)
    assert amx_from(0) == 0
    on_vdpbf16ps = cpu_native.bf16_linear(x, packed, None, n)
    torch.testing.assert_close(on_amx.float(), on_vdpbf16ps.float(), atol=0.05, rtol=2**-7)
    lin = torch.nn.Linear(k, n).bfloat16()
    off = layers.PackedLinear(lin.weight, lin.bias, amx=True, register=False)
    assert off.native_max_rows == layers.BF16_NATIVE_MAX_ROWS_WITHOUT_AMX_TILES
    assert amx_from(native_build.AMX_MIN_ROWS_DEFAULT) == native_build.AMX_MIN_ROWS_DEFAULT
    on = layers.PackedLinear(lin.weight, lin.bias, amx=True, register=False)
    assert on.native_max_rows == layers.BF16_NATIVE_MAX_ROWS_WITH_AMX
    # oneDNN's copy for the rows past them, where oneDNN packs bf16 (not on an AVX2 host emulating AMX)
    assert (on.packed is not None) == layers.onednn_linear_available(torch.bfloat16)


@needs_amx
@pytest.mark.parametrize("rows", [4, 5, 17, 33])
def test_the_head_screens_float32_sums_on_amx_tiles(rows, amx_from):
    """The head screen's bf16 copy on AMX tiles (llmd_bf16_linear_f32out, float32 output): the exact products' sums
    within K float32 roundings, and the screen's tokens are the whole head's."""
    from llmdeploy.engine.models import head_screen
    from tests.kernels.test_head_screen import assert_float32_sums, screened_argmax, whole_head_argmax

    assert amx_from(1) == 1
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(70, 96, generator=g) * 0.05).bfloat16()
    assert_float32_sums(torch.randn(rows, 96, generator=g).bfloat16(), w, cpu_native.bf16_pack(w))
    vocab, k = 32 * 60 + 5, 128
    head = torch.randn(vocab, k, generator=g) * 0.05
    packed, screen = cpu_native.f32_pack(head), head_screen.build(head)
    x = torch.randn(rows, k, generator=g)
    got = screened_argmax(screen, packed, x, vocab)
    assert got is not None and got[0] == whole_head_argmax(packed, x, vocab)


@needs_amx
def test_amx_linear_declines_k_off_its_tiles(amx_from):
    """K not a multiple of 32: the vdpbf16ps kernel runs those rows (same bound)."""
    assert amx_from(1) == 1
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(40, 46, generator=g).bfloat16(), torch.randn(33, 46, generator=g).bfloat16()
    exact = torch.nn.functional.linear(x.double(), w.double())
    out = cpu_native.bf16_linear(x, cpu_native.bf16_pack(w), None, 40)
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
