"""The native prefill attention, bf16 (kernels/csrc/prefill_attention.c, AVX-512 BF16, else widened by
prefill_attention_f32.c) and float32 (prefill_attention_f32.c, AVX2 + FMA), against the float64 definition and the
torch path it replaces: causal chunks at any position of a context read in place from scattered cache blocks."""

from __future__ import annotations

import pytest
import torch

from llmdeploy.kernels import native_attention, native_build
from llmdeploy.kernels import reference as ops
from tests.kernels.test_cpu_native import paged

pytestmark = pytest.mark.usefixtures("two_threads")

BF16 = pytest.param(
    torch.bfloat16,
    id="bf16",
    marks=pytest.mark.skipif(
        not (native_build.available() and native_build.library().llmd_has_avx2()),
        reason="the native bf16 prefill attention needs AVX-512 BF16, or AVX2 + FMA to widen it",
    ),
)
F32 = pytest.param(
    torch.float32,
    id="f32",
    marks=pytest.mark.skipif(
        not (native_build.available() and native_build.library().llmd_has_avx2()),
        reason="the native float32 prefill attention needs AVX2 + FMA",
    ),
)
# bf16: output rounding (2^-9 relative) plus the probabilities' rounding to bf16 (2^-9 of |v| <= ~4 where a row sees
# few keys and their values cancel); float32: summation order only
TOLERANCE = {torch.bfloat16: 8e-3, torch.float32: 2e-5}

CASES = [  # (chunk length, context length, kv heads, group, head dim, block size)
    (1, 1, 3, 3, 64, 16),  # a one-token prompt
    (5, 5, 3, 3, 64, 16),
    (1, 77, 2, 4, 64, 16),  # one query at the end of a context: the last chunk of a prompt
    (33, 33, 3, 3, 64, 16),  # a whole prompt one key past a tile
    (32, 700, 3, 3, 64, 16),  # a late chunk of a long prompt
    (96, 1400, 3, 3, 64, 32),
    (300, 300, 1, 8, 64, 16),  # eight query heads on one kv head
    (70, 130, 4, 1, 128, 16),  # no GQA, head dim 128 (two p.v passes)
    (17, 500, 2, 5, 128, 32),  # rows per kv head not a multiple of the kernel's row block
    (9, 40, 2, 3, 80, 16),  # head dim 80: AVX-512 BF16's kernel declines it, the widening one takes it
]


def definition(q, k_cache, v_cache, table, ctx, scale) -> torch.Tensor:
    """Causal attention of q (the last len(q) positions) in float64 over the gathered cache."""
    k = ops.gather_kv(k_cache, table[None], ctx)[0].double()
    v = ops.gather_kv(v_cache, table[None], ctx)[0].double()
    return ops.causal_attention(q.double(), k, v, ctx - q.shape[0], scale)


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("n,ctx,hkv,group,head_dim,block_size", CASES)
def test_prefill_matches_the_definition_and_the_torch_path(dtype, n, ctx, hkv, group, head_dim, block_size):
    k, v, bt, _ = paged([ctx], hkv, head_dim, block_size, dtype, seed=n + ctx)
    q = torch.randn(n, hkv * group, head_dim, generator=torch.Generator().manual_seed(ctx)).to(dtype)
    scale = head_dim**-0.5
    out = native_attention.prefill_attention(q, k, v, bt[0], ctx, scale)
    assert out is not None and out.shape == q.shape and out.dtype == dtype
    ref = definition(q, k, v, bt[0], ctx, scale)
    torch.testing.assert_close(out.double(), ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch_path = ops.causal_attention(
        q, ops.gather_kv(k, bt[:1], ctx)[0], ops.gather_kv(v, bt[:1], ctx)[0], ctx - n, scale
    )
    assert (out.double() - ref).abs().mean() <= 1.5 * (torch_path.double() - ref).abs().mean() + 1e-4


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_prefill_op_runs_every_sequence_of_a_step_natively(dtype, monkeypatch):
    """paged_prefill_attention over three chunks (one a prefix-cache hit on another's blocks): the native kernel
    answers each, and the whole step agrees with the torch path."""
    lens, chunks = [40, 260, 9], [40, 32, 9]
    k, v, bt, cl = paged(lens, 3, 64, 16, dtype, share=2)
    q = torch.randn(sum(chunks), 9, 64).to(dtype)
    cu = torch.tensor([0, 40, 72, 81], dtype=torch.int32)
    calls = []
    native = native_attention.prefill_attention
    monkeypatch.setattr(native_attention, "prefill_attention", lambda *a: calls.append(1) or native(*a))
    out = ops.paged_prefill_attention(q, k, v, cu, cl, bt, 0.125)
    assert len(calls) == 3
    monkeypatch.setattr(native_attention, "prefill_attention", lambda *a: None)
    torch_path = ops.paged_prefill_attention(q, k, v, cu, cl, bt, 0.125)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), torch_path.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_prefill_reads_a_strided_query(dtype):
    k, v, bt, _ = paged([50], 3, 64, 16, dtype)
    qkv = torch.randn(20, 9 + 6, 64).to(dtype)
    q = qkv[:, :9]  # a view into the fused qkv output, as the model passes it
    torch.testing.assert_close(
        native_attention.prefill_attention(q, k, v, bt[0], 50, 0.125),
        native_attention.prefill_attention(q.contiguous(), k, v, bt[0], 50, 0.125),
        atol=0,
        rtol=0,
    )


@pytest.mark.parametrize("dtype", [BF16])
def test_prefill_declines_what_it_does_not_cover(dtype):
    k, v, bt, cl = paged([20], 2, 64, 16, torch.bfloat16)
    q = torch.randn(8, 4, 64).bfloat16()
    assert native_attention.prefill_attention(q.float(), k, v, bt[0], 20, 0.125) is None  # a float32 query
    assert (
        native_attention.prefill_attention(q, k.float(), v.float(), bt[0], 20, 0.125) is None
    )  # a float32 cache
    assert native_attention.prefill_attention(q, k, v, bt[0], 5, 0.125) is None  # more queries than context
    k72, v72, bt72, _ = paged([20], 2, 72, 16, torch.bfloat16)
    q72 = torch.randn(8, 4, 72).bfloat16()
    assert native_attention.prefill_attention(q72, k72, v72, bt72[0], 20, 0.125) is None  # head dim 72
    # the op itself still answers, through the torch path
    cu = torch.tensor([0, 8], dtype=torch.int32)
    out = ops.paged_prefill_attention(q72, k72, v72, cu, cl, bt72, 0.125)
    torch.testing.assert_close(
        out.double(), definition(q72, k72, v72, bt72[0], 20, 0.125), atol=8e-3, rtol=8e-3
    )


@pytest.mark.parametrize("dtype", [F32])
def test_float32_prefill_declines_what_it_does_not_cover(dtype):
    k, v, bt, cl = paged([20], 2, 72, 16)
    q = torch.randn(8, 4, 72)
    assert (
        native_attention.prefill_attention(q, k, v, bt[0], 20, 0.125) is None
    )  # head dim 72: not whole 16-dim columns
    assert (
        native_attention.prefill_attention(q.half(), k.half(), v.half(), bt[0], 20, 0.125) is None
    )  # float16
    assert (
        native_attention.prefill_attention(q[:, :3], k, v, bt[0], 20, 0.125) is None
    )  # 3 query heads on 2 kv heads
    cu = torch.tensor([0, 8], dtype=torch.int32)
    out = ops.paged_prefill_attention(q, k, v, cu, cl, bt, 0.125)  # the op answers through the torch path
    torch.testing.assert_close(out.double(), definition(q, k, v, bt[0], 20, 0.125), atol=1e-5, rtol=1e-5)
