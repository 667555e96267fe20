"""Paged decode and prefill attention kernels against kernels/reference.py (interpreted on CPU, compiled on CUDA)."""

from __future__ import annotations

import itertools

import pytest
import torch

from llmdeploy.kernels import reference as ref
from llmdeploy.kernels import triton_ops
from llmdeploy.kernels.triton_decode import choose_num_splits, decode_attention
from llmdeploy.kernels.triton_prefill import prefill_attention
from tests.kernels.triton_cases import DEVICE, paged_case, randn

# ragged, length 1, both sides of the 16- and 32-token block boundaries, and one long enough to split
DECODE_LENS = [150, 33, 1, 15, 16, 17, 31, 32]  # the first two share a prefix block
GQA = [(2, 2), (8, 2), (8, 1)]  # (query heads, kv heads): ratios 1, 4, 8
HEAD_DIMS = [64, 80, 96, 128]
# (q_len, context_len): whole prompts, length 1, block boundaries, chunks after cached prefixes
PREFILL_CHUNKS = [(17, 40), (31, 47), (1, 1), (16, 16), (15, 15), (33, 33), (5, 32), (70, 70)]
FP32_TOL = dict(atol=1e-4, rtol=1e-4)


def decode_cases():
    """Every GQA ratio with every head dim; block size and split mode vary across them (and both values of
    each appear for every ratio) so the interpreter stays fast."""
    pages, splits = itertools.cycle([16, 32]), itertools.cycle([1, 3, None])
    return [(h, hkv, d, next(pages), next(splits)) for (h, hkv), d in itertools.product(GQA, HEAD_DIMS)]


def run_decode(h, hkv, d, page, splits, dtype=torch.float32, block_n=None, shared=1):
    case = paged_case(DECODE_LENS, page, hkv, d, dtype, shared_prefix_blocks=shared)
    q = randn(len(DECODE_LENS), h, d, dtype=dtype)
    scale = d**-0.5
    want = ref.paged_attention_decode(
        q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, scale
    )
    got = decode_attention(
        q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.context_lens,
        scale,
        max(DECODE_LENS),
        splits,
        block_n=block_n,
    )
    return got, want


@pytest.mark.parametrize("h,hkv,d,page,splits", decode_cases())
def test_decode_matches_reference(h, hkv, d, page, splits):
    got, want = run_decode(h, hkv, d, page, splits)
    torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("splits", [1, 4, 16])
def test_decode_split_partitions_smaller_than_a_tile(splits):
    """block_n 16 makes partitions of 16 tokens: many splits, empty ones for short sequences, merged exactly."""
    got, want = run_decode(8, 2, 64, 16, splits, block_n=16)
    torch.testing.assert_close(got, want, **FP32_TOL)


def test_decode_public_op_small_head_dim_and_heuristic():
    """The public op (heuristic splits, max_context_len omitted) at the tiny test model's head_dim 16."""
    case = paged_case([3, 40, 17], 16, 2, 16)
    q = randn(3, 4, 16)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25)
    torch.testing.assert_close(
        triton_ops.paged_attention_decode(*args), ref.paged_attention_decode(*args), **FP32_TOL
    )


def test_decode_bf16_under_any_backend():
    got, want = run_decode(8, 2, 128, 16, 2, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_choose_num_splits_heuristic():
    assert choose_num_splits(64, 8, 2048, 132) == 2  # the H200 headline shape: 512 programs, 528 wanted
    assert choose_num_splits(1, 8, 32768, 132) == 32  # one long sequence: as many as allowed
    assert choose_num_splits(1, 8, 300, 132) == 2  # never below MIN_PARTITION tokens per split
    assert choose_num_splits(256, 8, 4096, 132) == 1  # the batch alone fills the GPU
    assert choose_num_splits(4, 2, 1, 4) == 1


def prefill_inputs(h, hkv, d, page, dtype=torch.float32, chunks=PREFILL_CHUNKS, shared=1):
    ctx = [c for _, c in chunks]
    case = paged_case(ctx, page, hkv, d, dtype, shared_prefix_blocks=shared)
    q_lens = [q for q, _ in chunks]
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    q = randn(sum(q_lens), h, d, dtype=dtype, seed=2)
    return q, case, cu, max(q_lens), max(ctx)


def prefill_cases():
    pages, tiles = itertools.cycle([16, 32]), itertools.cycle([None, 16])
    return [(h, hkv, d, next(pages), next(tiles)) for (h, hkv), d in itertools.product(GQA, HEAD_DIMS)]


@pytest.mark.parametrize("h,hkv,d,page,block_m", prefill_cases())
def test_prefill_matches_reference(h, hkv, d, page, block_m):
    q, case, cu, max_q, max_ctx = prefill_inputs(h, hkv, d, page)
    scale = d**-0.5
    want = ref.paged_prefill_attention(
        q, case.k_cache, case.v_cache, cu, case.context_lens, case.block_tables, scale
    )
    got = prefill_attention(
        q,
        case.k_cache,
        case.v_cache,
        cu,
        case.context_lens,
        case.block_tables,
        scale,
        max_q,
        max_ctx,
        block_m=block_m,
        block_n=16 if block_m else None,
    )
    torch.testing.assert_close(got, want, **FP32_TOL)


def test_prefill_public_op_without_size_hints():
    """Sizes computed from the tensors when the optional ints are not given (and 0, as AttentionMetadata's default)."""
    q, case, cu, _, _ = prefill_inputs(4, 2, 16, 16, chunks=[(9, 9), (3, 20)], shared=0)
    args = (q, case.k_cache, case.v_cache, cu, case.context_lens, case.block_tables, 0.25)
    want = ref.paged_prefill_attention(*args)
    torch.testing.assert_close(triton_ops.paged_prefill_attention(*args), want, **FP32_TOL)
    torch.testing.assert_close(triton_ops.paged_prefill_attention(*args, 0, 0), want, **FP32_TOL)


def test_prefill_bf16_under_any_backend():
    q, case, cu, max_q, max_ctx = prefill_inputs(8, 2, 64, 16, torch.bfloat16, chunks=PREFILL_CHUNKS[:5])
    args = (q, case.k_cache, case.v_cache, cu, case.context_lens, case.block_tables, 0.125)
    got = triton_ops.paged_prefill_attention(*args, max_q, max_ctx)
    torch.testing.assert_close(got.float(), ref.paged_prefill_attention(*args).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("h,hkv,d,page,splits", decode_cases())
def test_decode_bf16_cuda(h, hkv, d, page, splits):
    got, want = run_decode(h, hkv, d, page, splits, dtype=torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("h,hkv,d,page,block_m", prefill_cases())
def test_prefill_bf16_cuda(h, hkv, d, page, block_m):
    q, case, cu, max_q, max_ctx = prefill_inputs(h, hkv, d, page, torch.bfloat16)
    args = (q, case.k_cache, case.v_cache, cu, case.context_lens, case.block_tables, d**-0.5)
    got = prefill_attention(*args, max_q, max_ctx, block_m=block_m)
    torch.testing.assert_close(got.float(), ref.paged_prefill_attention(*args).float(), atol=2e-2, rtol=2e-2)
