"""The LM head's screen (kernels/csrc/head_screen.c, engine/models/head_screen.py): at each row its greedy token is
the whole head's (the first index of the largest exact logit), through ties, near-ties and rows the screen cannot
tell apart, from its Q8 copy at a few rows and a float32 head's bf16 copy at more (CPUs with AVX-512 BF16); where
too many tiles may hold the largest it declines. Also through an engine: greedy tokens with the screen are the
tokens without it, and the screen answered the bursts' steps and the single greedy steps of larger batches."""

from __future__ import annotations

import ctypes

import pytest
import torch

from llmdeploy.engine import LLM, SamplingParams
from llmdeploy.engine.models import head_screen, quant
from llmdeploy.engine.models.quant import quantize_q8
from llmdeploy.kernels import cpu_native, native_build
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(native_build.library() is None, reason="needs the native kernels")
DTYPES = ["float32", "bfloat16"]


def packs(dtype: str) -> bool:
    return cpu_native.bf16_linear_available() if dtype == "bfloat16" else cpu_native.f32_linear_available()


def whole_head_argmax(packed: torch.Tensor, x: torch.Tensor, vocab: int) -> list[int]:
    """Each row's token from the whole head's logits, x [K] or [M, K] in one call."""
    logits = cpu_native.native_linear(x.reshape(-1, x.shape[-1]), packed, None, vocab).float()
    return logits.argmax(dim=-1).tolist()  # torch: the first index of the largest


def screened_argmax(
    screen, packed: torch.Tensor, x: torch.Tensor, vocab: int
) -> tuple[list[int], int] | None:
    """Each row's token and the candidate tiles read (all rows), or None where the screen declined; x [K] or
    [M, K]."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    best, tiles = (ctypes.c_int64 * rows.shape[0])(), ctypes.c_int64(-1)
    struct = screen.struct()
    rc = native_build.library().llmd_head_screen_argmax(
        ctypes.byref(struct),
        int(x.dtype == torch.bfloat16),
        packed.data_ptr(),
        vocab,
        rows.shape[1],
        rows.data_ptr(),
        rows.shape[0],
        best,
        ctypes.byref(tiles),
        native_build.threads(),
    )
    assert rc in (0, 1)
    return (list(best), tiles.value) if rc == 0 else None


def head(dtype: str, vocab: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, k, generator=g) * 0.05).to(getattr(torch, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_screened_token_is_the_whole_heads_on_random_rows(dtype):
    if not packs(dtype):
        pytest.skip(f"no native {dtype} linear here")
    vocab, k = 32 * 160 + 7, 128  # a partial last tile
    w = head(dtype, vocab, k, 0)
    packed, screen = cpu_native.native_pack(w), head_screen.build(w)
    assert screen is not None
    g = torch.Generator().manual_seed(1)
    read = []
    for i in range(60):
        x = (torch.randn(k, generator=g) * (0.5 + i % 5)).to(w.dtype)
        got = screened_argmax(screen, packed, x, vocab)
        assert got is not None, "declined on a random row"
        assert got[0] == whole_head_argmax(packed, x, vocab)
        read.append(got[1])
    assert max(read) < -(-vocab // 32) // 4  # most of the head is never computed exactly


def bf16_copy(dtype: str) -> bool:
    """Whether a head of this dtype gets the bf16 copy here (float32, AVX-512 BF16)."""
    return dtype == "float32" and cpu_native.avx512_bf16_available()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8, 32])
def test_several_rows_each_get_the_whole_heads_token(dtype, rows):
    """A decode step's rows at once: each row's token is the one the whole head's batched call gives it; the Q8
    copy takes a few rows (3 bf16, 4 float32), a float32 head's bf16 copy more, and no screen declines."""
    if not packs(dtype):
        pytest.skip(f"no native {dtype} linear here")
    vocab, k = 32 * 100 + 3, 96
    w = head(dtype, vocab, k, 10)
    packed, screen = cpu_native.native_pack(w), head_screen.build(w)
    takes = rows <= (3 if dtype == "bfloat16" else 4) or bf16_copy(dtype)
    assert screen.takes(rows, dtype == "bfloat16") == takes
    g = torch.Generator().manual_seed(11)
    for i in range(20):
        x = (torch.randn(rows, k, generator=g) * torch.linspace(0.3, 3.0, rows)[:, None] * (1 + i % 3)).to(
            w.dtype
        )
        got = screened_argmax(screen, packed, x, vocab)
        if not takes:
            assert got is None
            continue
        assert got is not None
        assert got[0] == whole_head_argmax(packed, x, vocab)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 8])
def test_ties_and_near_ties_keep_the_first_index(dtype, rows):
    """Copies of the winning row later in the head (exact ties), and rows one float step away from it: the answer
    is the whole head's first index of the largest, wherever the copies sit; at 8 rows a float32 head's bf16 copy
    screens (the input row at 8 scales)."""
    if not packs(dtype):
        pytest.skip(f"no native {dtype} linear here")
    vocab, k = 32 * 24, 64
    w = head(dtype, vocab, k, 2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(k, generator=g).to(w.dtype)
    [top] = whole_head_argmax(cpu_native.native_pack(w), x, vocab)
    xs = (x.float() * torch.linspace(0.5, 4.0, rows)[:, None]).to(w.dtype)
    for copy_at in (top + 1, vocab - 1, 5, 33):
        if copy_at == top:
            continue
        tied = w.clone()
        tied[copy_at] = w[top]
        nudged = tied.clone()
        step = torch.nextafter(w[top].float(), torch.full((k,), 1e9)).to(w.dtype)
        nudged[(copy_at + 200) % vocab] = step  # a row a hair above or below the winner's
        for heads in (tied, nudged):
            packed, screen = cpu_native.native_pack(heads), head_screen.build(heads)
            got = screened_argmax(screen, packed, xs, vocab)
            if not screen.takes(rows, dtype == "bfloat16"):
                assert got is None
                continue
            assert got is not None
            assert got[0] == whole_head_argmax(packed, xs, vocab)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 8])
def test_a_flat_head_is_declined(dtype, rows):
    """Rows the screen's copy cannot tell apart put most tiles among the candidates: the whole head is cheaper."""
    if not packs(dtype):
        pytest.skip(f"no native {dtype} linear here")
    vocab, k = 32 * 16, 64
    base = head(dtype, 1, k, 4).float()
    g = torch.Generator().manual_seed(5)
    w = (base + 1e-4 * torch.randn(vocab, k, generator=g)).to(getattr(torch, dtype))
    packed, screen = cpu_native.native_pack(w), head_screen.build(w)
    assert screened_argmax(screen, packed, torch.ones(rows, k, dtype=w.dtype), vocab) is None


@pytest.mark.parametrize("rows", [1, 8])
def test_a_logit_whose_sum_overflows_is_not_screened_away(rows):
    """A row whose products overflow (+1e40 and -1e40): the whole head's float32 sums make it +inf, the winner; the
    screen's sums, in another order (vdpbf16ps adds a pair's products its own way), may make it -inf or NaN. The
    screen must not answer with a finite row: it declines where a screened logit is not finite."""
    vocab, k = 32 * 40, 64
    w = head("float32", vocab, k, 14)
    w[70, 0], w[70, 1] = 1e10, -1e10
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(15))
    x[:, :2] = 1e30
    packed, screen = cpu_native.native_pack(w), head_screen.build(w)
    whole = whole_head_argmax(packed, x, vocab)
    assert whole == [70] * rows
    got = screened_argmax(screen, packed, x, vocab)
    assert got is None or got[0] == whole


def test_the_bound_covers_the_q8_rounding_of_every_row():
    """c_x1 is at least the largest weight error of its row, so c_x1 sum |x| bounds the logit's error."""
    w = head("float32", 70, 64, 6)
    blocks = quantize_q8(w)
    c_x1 = head_screen.bound_coefficients(w, blocks.dequantize())
    error = (w - blocks.dequantize()).abs().amax(dim=1)
    assert (c_x1 >= error).all() and (c_x1 > 0).all()
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(7))
    gap = (x.double() @ w.double().T - x.double() @ blocks.dequantize().double().T).abs()
    assert (gap <= x.abs().sum(dim=1, keepdim=True).double() * c_x1.double()).all()


def bf16_sums(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """llmd_bf16_linear_f32out: x [M, K] bf16 against a bf16-packed weight, float32 sums not rounded to bf16."""
    y = torch.empty(x.shape[0], n)
    rc = native_build.library().llmd_bf16_linear_f32out(
        x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(), x.shape[0], n, x.shape[1], 1
    )
    assert rc == 0
    return y


def assert_float32_sums(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor) -> None:
    """The sums are the exact bf16 products' sums within K float32 roundings of their magnitude (what the
    screen's bound allows them)."""
    out = bf16_sums(x, packed, w.shape[0]).double()
    exact = x.double() @ w.double().T
    allowed = x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert ((out - exact).abs() <= allowed).all()


@pytest.mark.parametrize("rows", [1, 5, 13, 32])
def test_the_bf16_copys_sums_are_float32_sums_of_exact_products(rows):
    if not bf16_copy("float32"):
        pytest.skip("no bf16 copy of a float32 head here: it needs AVX-512 BF16")
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(70, 96, generator=g) * 0.05).bfloat16()  # a channel tail in the last tile
    x = torch.randn(rows, 2 * 96, generator=g).bfloat16()[:, :96]  # a row stride
    assert_float32_sums(x, w, cpu_native.bf16_pack(w))


def test_the_row_that_wins_only_before_x_is_rounded_is_found():
    """bf16-exact weights, x rounding up under one row and down under another: the second wins the exact logits
    (2.0115 against 2.008) and loses the bf16 ones (2.0039 against 2.0156) by more than the weights' error allows;
    only the bound's |x - bf16(x)| term keeps its tile a candidate."""
    if not bf16_copy("float32"):
        pytest.skip("no bf16 copy of a float32 head here: it needs AVX-512 BF16")
    vocab, k = 32 * 40, 64
    w = torch.zeros(vocab, k)
    w[3, :2] = 1.0
    w[40, 32:35] = 171 / 256  # a bf16 value
    x = torch.zeros(8, k)
    x[:, :2], x[:, 32:35] = 1.0040, 1.0038  # bf16: 1.0078125 (up), 1.0 (down)
    packed, screen = cpu_native.native_pack(w), head_screen.build(w)
    assert whole_head_argmax(packed, x, vocab) == [40] * 8
    got = screened_argmax(screen, packed, x, vocab)
    assert got is not None and got[0] == [40] * 8


def test_the_l2_bound_covers_the_bf16_rounding_of_every_row():
    """A |x|_2 + B |x - bf16(x)|_2 bounds |x.w - bf16(x).w~| for every row (float64 products), also on a head and
    inputs with values across many binades and ones that round to subnormals."""
    g = torch.Generator().manual_seed(12)
    w = head("float32", 90, 64, 13) * torch.logspace(-3, 3, 64)[None, :]
    w[0, :8] = 1e-39  # below bf16's normal range: flushed
    rounded = head_screen.bf16_rounded(w).float()
    assert (rounded[0, :8] == 0).all()
    a, b = head_screen.l2_coefficients(w, rounded).double().unbind(dim=1)
    x = torch.randn(300, 64, generator=g) * torch.logspace(2, -2, 64)[None, :]
    xb = head_screen.bf16_rounded(x).double()
    gap = (x.double() @ w.double().T - xb @ rounded.double().T).abs()
    bound = x.double().norm(dim=1, keepdim=True) * a + (x.double() - xb).norm(dim=1, keepdim=True) * b
    assert (gap <= bound).all()
    assert (bound < 0.02 * x.double().norm(dim=1, keepdim=True) * w.double().norm(dim=1)).all()  # not vacuous


def test_built_in_row_chunks_it_is_the_same_screen(monkeypatch):
    if not packs("float32"):
        pytest.skip("no native float32 linear here")
    w = head("float32", 100, 64, 11)
    whole = head_screen.build(w)
    monkeypatch.setattr(head_screen, "QUANTIZE_ROWS", 7)
    monkeypatch.setattr(quant, "QUANTIZE_ROWS", 7)
    chunked = head_screen.build(w)
    assert whole is not None and chunked is not None
    assert torch.equal(chunked.q8, whole.q8) and torch.equal(chunked.c_x1, whole.c_x1)
    assert chunked.max_tiles == whole.max_tiles
    if whole.c_l2 is not None:  # the bf16 copy (AVX-512 BF16 CPUs)
        assert torch.equal(chunked.c_l2, whole.c_l2) and torch.equal(chunked.bf16, whole.bf16)
    else:
        assert chunked.c_l2 is None and chunked.bf16 is None


def test_no_screen_where_it_does_not_apply(monkeypatch):
    assert head_screen.build(head("float32", 64, 48, 7)) is None  # K not whole blocks of 32
    bad = head("float32", 64, 64, 8)
    bad[3, 5] = float("inf")
    assert head_screen.build(bad) is None
    huge = head("float32", 64, 64, 10)
    huge[2, 3] = 3.4e38  # finite in float32, infinite in bf16: the Q8 copy only
    screen = head_screen.build(huge)
    assert screen is not None and screen.bf16 is None and not screen.takes(8, False)
    monkeypatch.setenv(head_screen.ENV_SWITCH, "0")
    assert head_screen.build(head("float32", 64, 64, 9)) is None


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("screen"), "llama")


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_engines_greedy_tokens_are_the_same_with_the_screen(folder, dtype, monkeypatch):
    if not packs(dtype):
        pytest.skip(f"no native {dtype} linear here")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [[3, 17, 42, 9, 88], list(range(10, 40)), [7]]

    many = [[(5 * i + j) % 250 + 1 for j in range(3 + i)] for i in range(7)]  # single steps of 7 rows

    def run(screen: str) -> tuple[list[list[int]], int, int]:
        monkeypatch.setenv(head_screen.ENV_SWITCH, screen)
        llm = LLM(model=str(folder), dtype=dtype, max_model_len=128, kv_cache_gb=0.01, decode_burst=4)
        tokens = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]  # batch 1 each
        tokens += [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # bursts of 3 rows
        model = llm.engine.runner.model
        layers = next(m.native_decode.layers for m in model.modules() if hasattr(m, "native_decode"))
        few = layers.screened_steps if layers is not None else 0
        tokens += [o.outputs[0].token_ids for o in llm.generate(many, params)]
        return tokens, few, (layers.screened_steps - few) if layers is not None else 0

    with_screen, screened, screened_many = run("1")
    without, none, none_many = run("0")
    assert with_screen == without
    assert none == none_many == 0 and screened > 0
    assert (screened_many > 0) == bf16_copy(dtype)  # 7 rows: the bf16 copy's
