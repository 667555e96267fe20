"""The pure-PyTorch reference ops against naive dense formulas: ragged lengths, length 1, block boundaries,
blocks shared between sequences (prefix caching), GQA ratios 1/4/8, block sizes 16/32."""

from __future__ import annotations

import math

import pytest
import torch

from llmdeploy.kernels import native_build
from llmdeploy.kernels import reference as ops

D = 32


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> torch.Tensor:
    """q [Lq, H, D] at positions first_pos.., k/v [Lk, Hkv, D] at 0..; causal; float64 dense softmax."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    pos_q = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class PagedKV:
    """Random K/V of several sequences in a paged cache; `share` makes sequence 1 reuse sequence 0's first
    blocks, as a prefix-cache hit does."""

    def __init__(self, lens: list[int], num_kv_heads: int, block_size: int, share: int = 0, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        blocks = [-(-n // block_size) for n in lens]
        num_blocks = sum(blocks) + 3
        self.k_cache = torch.randn(num_blocks, block_size, num_kv_heads, D, generator=g)
        self.v_cache = torch.randn(num_blocks, block_size, num_kv_heads, D, generator=g)
        free = torch.randperm(num_blocks - 1, generator=g).add(1).tolist()  # scattered, never block 0
        tables = [[free.pop() for _ in range(b)] for b in blocks]
        if share:
            tables[1][:share] = tables[0][:share]
        width = max(blocks)
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        self.tables, self.lens = tables, lens

    def dense(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = [
            self.tables[i][p // self.block_size] * self.block_size + p % self.block_size
            for p in range(self.lens[i])
        ]
        flat = lambda c: c.view(-1, *c.shape[2:])[torch.tensor(slots)]  # noqa: E731
        return flat(self.k_cache), flat(self.v_cache)


SHAPES = [  # (context lens, kv heads, gqa group, block size, shared blocks)
    ([1, 17, 16, 33], 2, 1, 16, 0),
    ([40, 40, 5], 2, 4, 16, 2),
    ([1], 1, 8, 32, 0),
    ([64, 31, 32, 65], 1, 8, 32, 1),
    ([15, 2, 100], 4, 4, 16, 0),
    # decode runs the two long contexts apart from the padded batch
    ([20, 700, 31, 40, 300, 33], 2, 2, 16, 0),
]


@pytest.fixture(params=["native", "torch"])
def decode_path(request, monkeypatch) -> str:
    """Decode attention through the compiled kernel (K/V read in place) and through the torch gather path."""
    if request.param == "torch":
        monkeypatch.setattr(native_build, "library", lambda: None)
    elif not native_build.available():
        pytest.skip("the native CPU kernels do not build here (no C compiler)")
    return request.param


@pytest.mark.parametrize("lens,hkv,group,block_size,share", SHAPES)
def test_decode_matches_dense(lens, hkv, group, block_size, share, decode_path):
    kv = PagedKV(lens, hkv, block_size, share)
    q = torch.randn(len(lens), hkv * group, D)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    for max_len in (None, max(lens)):
        out = ops.paged_attention_decode(
            q, kv.k_cache, kv.v_cache, kv.block_tables, context_lens, D**-0.5, max_len
        )
        assert out.shape == q.shape and out.dtype == q.dtype
        for i, n in enumerate(lens):
            ref = naive_attention(q[i : i + 1], *kv.dense(i), first_pos=n - 1)
            torch.testing.assert_close(out[i : i + 1].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens,hkv,group,block_size,share", SHAPES)
def test_prefill_chunks_match_dense(lens, hkv, group, block_size, share):
    """Sequence i's chunk is its last q_len_i positions: whole prompts, later chunks and 1-token chunks."""
    kv = PagedKV(lens, hkv, block_size, share)
    q_lens = [n if i % 2 == 0 else max(1, n // 3) for i, n in enumerate(lens)]
    q = torch.randn(sum(q_lens), hkv * group, D)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    out = ops.paged_prefill_attention(
        q,
        kv.k_cache,
        kv.v_cache,
        cu,
        torch.tensor(lens, dtype=torch.int32),
        kv.block_tables,
        D**-0.5,
        max(q_lens),
        max(lens),
    )
    for i, (n, ql) in enumerate(zip(lens, q_lens, strict=True)):
        ref = naive_attention(q[cu[i] : cu[i + 1]], *kv.dense(i), first_pos=n - ql)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]].double(), ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_cache_attention_is_close(decode_path):
    kv = PagedKV([20, 7], 2, 16)
    q = torch.randn(2, 8, D, dtype=torch.bfloat16)
    out = ops.paged_attention_decode(
        q,
        kv.k_cache.bfloat16(),
        kv.v_cache.bfloat16(),
        kv.block_tables,
        torch.tensor([20, 7], dtype=torch.int32),
        D**-0.5,
    )
    assert out.dtype == torch.bfloat16
    for i in range(2):
        ref = naive_attention(q[i : i + 1].float(), *kv.dense(i), first_pos=kv.lens[i] - 1)
        torch.testing.assert_close(out[i : i + 1].double(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_writes_slots_and_skips_padding(block_size):
    k_cache = torch.zeros(4, block_size, 2, D)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(5, 2, D), torch.randn(5, 2, D)
    slots = torch.tensor([3, block_size, -1, 2 * block_size + 5, 4 * block_size - 1])
    ops.store_kv(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, D), v_cache.view(-1, 2, D)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], key[i]) and torch.equal(flat_v[s], value[i])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(flat_k.shape[0]) if s not in written]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()
    ops.store_kv(
        key, value, k_cache.bfloat16(), v_cache.bfloat16(), slots.clamp(min=0)
    )  # casts to cache dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers_rounding(dtype):
    x, res = torch.randn(7, 48, dtype=dtype), torch.randn(7, 48, dtype=dtype)
    w = torch.randn(48, dtype=dtype)
    out, new_res = ops.rms_norm(x, w, 1e-6, res)
    h = (x + res).float()
    ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)  # LlamaRMSNorm
    assert torch.equal(new_res, x + res)
    torch.testing.assert_close(out, ref, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5)
    out2, res2 = ops.rms_norm(x, w, 1e-6)
    assert res2 is x and out2.shape == x.shape


def test_rotary_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    max_pos, n = 64, 9
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    positions = torch.tensor([0, 1, 2, 63, 5, 5, 17, 30, 31])
    q, k = torch.randn(n, 4, D), torch.randn(n, 2, D)
    emb = torch.cat((freqs, freqs), dim=-1)[positions]
    ref_q, ref_k = apply_rotary_pos_emb(
        q.transpose(0, 1), k.transpose(0, 1), emb.cos(), emb.sin(), unsqueeze_dim=0
    )
    out_q, out_k = ops.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(out_q, ref_q.transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_k, ref_k.transpose(0, 1), atol=1e-6, rtol=1e-6)
