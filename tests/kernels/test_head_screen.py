"""The LM head's Q8 screen (kernels/csrc/head_screen.c, engine/models/head_screen.py): at each of a few rows its
greedy token is the whole head's (the first index of the largest exact logit), through ties, near-ties and rows
the screen cannot tell apart; where too many tiles may hold the largest it declines. Also through an engine: greedy
tokens with the screen are the tokens without it, and the screen answered the bursts' steps."""

from __future__ import annotations

import ctypes

import pytest
import torch

from llmdeploy.engine import LLM, SamplingParams
from llmdeploy.engine.models import head_screen
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [2, 4])
def test_several_rows_each_get_the_whole_heads_token(dtype, rows):
    """A decode burst's rows at once: each row's token is the one the whole head's batched call gives it."""
    if not packs(dtype):
        pytest.skip(f"no native {dtype} linear here")
    vocab, k = 32 * 100 + 3, 96
    w = head(dtype, vocab, k, 10)
    packed, screen = cpu_native.native_pack(w), head_screen.build(w)
    g = torch.Generator().manual_seed(11)
    for i in range(20):
        x = (torch.randn(rows, k, generator=g) * torch.linspace(0.3, 3.0, rows)[:, None] * (1 + i % 3)).to(
            w.dtype
        )
        got = screened_argmax(screen, packed, x, vocab)
        assert got is not None
        assert got[0] == whole_head_argmax(packed, x, vocab)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_and_near_ties_keep_the_first_index(dtype):
    """Copies of the winning row later in the head (exact ties), and rows one float step away from it: the answer
    is the whole head's first index of the largest, wherever the copies sit."""
    if not packs(dtype):
        pytest.skip(f"no native {dtype} linear here")
    vocab, k = 32 * 24, 64
    w = head(dtype, vocab, k, 2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(k, generator=g).to(w.dtype)
    [top] = whole_head_argmax(cpu_native.native_pack(w), x, vocab)
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
            got = screened_argmax(screen, packed, x, vocab)
            assert got is not None
            assert got[0] == whole_head_argmax(packed, x, vocab)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_flat_head_is_declined(dtype):
    """Rows the Q8 copy cannot tell apart put most tiles among the candidates: the whole head is cheaper."""
    if not packs(dtype):
        pytest.skip(f"no native {dtype} linear here")
    vocab, k = 32 * 16, 64
    base = head(dtype, 1, k, 4).float()
    g = torch.Generator().manual_seed(5)
    w = (base + 1e-4 * torch.randn(vocab, k, generator=g)).to(getattr(torch, dtype))
    packed, screen = cpu_native.native_pack(w), head_screen.build(w)
    assert screened_argmax(screen, packed, torch.ones(k, dtype=w.dtype), vocab) is None


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


def test_no_screen_where_it_does_not_apply(monkeypatch):
    assert head_screen.build(head("float32", 64, 48, 7)) is None  # K not whole blocks of 32
    bad = head("float32", 64, 64, 8)
    bad[3, 5] = float("inf")
    assert head_screen.build(bad) is None
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

    def run(screen: str) -> tuple[list[list[int]], int]:
        monkeypatch.setenv(head_screen.ENV_SWITCH, screen)
        llm = LLM(model=str(folder), dtype=dtype, max_model_len=128, kv_cache_gb=0.01, decode_burst=4)
        tokens = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]  # batch 1 each
        tokens += [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # bursts of 3 rows
        model = llm.engine.runner.model
        layers = next(m.native_decode.layers for m in model.modules() if hasattr(m, "native_decode"))
        return tokens, layers.screened_steps if layers is not None else 0

    with_screen, screened = run("1")
    without, none = run("0")
    assert with_screen == without
    assert none == 0 and screened > 0
