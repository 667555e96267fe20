"""store_kv, rms_norm and rotary_embedding kernels against kernels/reference.py."""

from __future__ import annotations

import pytest
import torch

from llmdeploy.kernels import reference as ref
from llmdeploy.kernels import triton_ops
from tests.kernels.triton_cases import DEVICE, randn

FP32_TOL = dict(atol=1e-4, rtol=1e-4)


def qkv_views(n: int, h: int, hkv: int, d: int, dtype=torch.float32, seed: int = 1):
    """q/k/v as the model makes them: strided views into one fused projection output."""
    qkv = randn(n, (h + 2 * hkv) * d, dtype=dtype, seed=seed)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    return q.view(n, h, d), k.view(n, hkv, d), v.view(n, hkv, d)


@pytest.mark.parametrize(
    "hkv,d,page,cache_dtype",
    [
        (1, 64, 16, torch.float32),
        (2, 80, 32, torch.float32),
        (8, 128, 16, torch.float32),
        (2, 96, 16, torch.bfloat16),
    ],
)
def test_store_kv_matches_reference(hkv, d, page, cache_dtype):
    _, k, v = qkv_views(9, 2, hkv, d, dtype=cache_dtype)
    # padding (-1) slots, slots on both sides of a block boundary, the last slot of the cache
    slots = torch.tensor([3, -1, page - 1, page, 2 * page + 5, -1, 5 * page - 1, 7, page + 1], device=DEVICE)
    caches = [randn(5, page, hkv, d, dtype=cache_dtype, seed=s) for s in (2, 3)]
    want_k, want_v = caches[0].clone(), caches[1].clone()
    ref.store_kv(k, v, want_k, want_v, slots)
    got_k, got_v = caches[0].clone(), caches[1].clone()
    triton_ops.store_kv(k, v, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_store_kv_all_padding_and_empty():
    k = randn(3, 2, 64)
    cache = randn(2, 16, 2, 64, seed=4)
    before = cache.clone()
    triton_ops.store_kv(k, k, cache, cache, torch.full((3,), -1, device=DEVICE))
    triton_ops.store_kv(k[:0], k[:0], cache, cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("hidden", [64, 96, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(hidden, with_residual):
    x = randn(7, hidden, seed=1)
    res = randn(7, hidden, seed=2) if with_residual else None
    w = randn(hidden, seed=3)
    got, got_res = triton_ops.rms_norm(x, w, 1e-6, res)
    want, want_res = ref.rms_norm(x, w, 1e-6, res)
    torch.testing.assert_close(got, want, **FP32_TOL)
    torch.testing.assert_close(got_res, want_res, atol=0, rtol=0)
    if not with_residual:
        assert got_res is x


def test_rms_norm_per_head_on_strided_view():
    """Qwen3's q/k norm: [N, H, D] views into the fused projection, normalised over D."""
    q, _, _ = qkv_views(5, 4, 2, 64)
    w = randn(64, seed=5)
    got, _ = triton_ops.rms_norm(q, w, 1e-6)
    want, _ = ref.rms_norm(q, w, 1e-6)
    assert got.shape == q.shape
    torch.testing.assert_close(got, want, **FP32_TOL)


def cos_sin_cache(max_pos: int, d: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)


@pytest.mark.parametrize("h,hkv,d", [(2, 2, 64), (8, 2, 80), (8, 1, 96), (4, 1, 128), (4, 2, 16)])
def test_rotary_matches_reference(h, hkv, d):
    q, k, _ = qkv_views(6, h, hkv, d)
    positions = torch.tensor([0, 1, 17, 5, 63, 40], device=DEVICE)
    cache = cos_sin_cache(64, d)
    got_q, got_k = triton_ops.rotary_embedding(positions, q, k, cache)
    want_q, want_k = ref.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(got_q, want_q, **FP32_TOL)
    torch.testing.assert_close(got_k, want_k, **FP32_TOL)
    assert got_q.is_contiguous() and got_q.shape == q.shape


def test_norm_and_rotary_bf16():
    x, res, w = (
        randn(4, 128, dtype=torch.bfloat16),
        randn(4, 128, dtype=torch.bfloat16, seed=2),
        randn(128, dtype=torch.bfloat16, seed=3),
    )
    for got, want in zip(triton_ops.rms_norm(x, w, 1e-5, res), ref.rms_norm(x, w, 1e-5, res), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    q, k, _ = qkv_views(4, 4, 2, 64, dtype=torch.bfloat16)
    pos = torch.tensor([3, 0, 9, 1], device=DEVICE)
    for got, want in zip(
        triton_ops.rotary_embedding(pos, q, k, cos_sin_cache(16, 64)),
        ref.rotary_embedding(pos, q, k, cos_sin_cache(16, 64)),
        strict=True,
    ):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hidden", [2048, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_cuda(hidden, dtype):
    x, res, w = (
        randn(33, hidden, dtype=dtype),
        randn(33, hidden, dtype=dtype, seed=2),
        randn(hidden, dtype=dtype, seed=3),
    )
    for got, want in zip(triton_ops.rms_norm(x, w, 1e-6, res), ref.rms_norm(x, w, 1e-6, res), strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
