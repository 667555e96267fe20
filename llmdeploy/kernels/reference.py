"""Pure-PyTorch reference ops. They define what each Triton kernel must compute, and they are the CPU path.

On CPU, decode attention runs the compiled kernel of kernels/native_attention.py where it builds (K/V read in place from
the paged cache, no per-step gather, no padding); `decode_by_gather` is the same op in torch, used without a C
compiler and as the definition the native kernel is tested against.

Shapes (the contract shared with kernels/triton_ops.py and engine/attention.py):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (one pair per layer)
  slot_mapping:     [num_tokens] int64, slot = block_id * block_size + offset; -1 = do not store
  block_tables:     [num_seqs, max_blocks] int32, padded with 0 (never read past context_lens)
  context_lens:     [num_seqs] int32, tokens in the cache for that sequence *including* this step's tokens
  cu_seqlens_q:     [num_seqs + 1] int32, prefix sums of the query chunk lengths (prefill)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmdeploy.kernels import cpu_native, native_attention


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim] -> written into the paged cache at slot_mapping."""
    if bool((slot_mapping < 0).any()):  # padding rows are rare: mask only when there are some
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if key.dtype != k_cache.dtype:
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_context_len: int) -> torch.Tensor:
    """[num_seqs, max_blocks] block ids -> [num_seqs, max_context_len, num_kv_heads, head_dim] (padded rows are garbage)."""
    num_blocks, block_size = cache.shape[:2]
    used = -(-max_context_len // block_size)
    ids = block_tables[:, :used].flatten()  # int32 indexes directly (no int64 copy)
    # index_select over whole blocks is one memcpy per block (advanced indexing is several times slower)
    gathered = cache.view(num_blocks, -1).index_select(0, ids)
    return gathered.view(block_tables.shape[0], used * block_size, *cache.shape[2:])[:, :max_context_len]


# Decode pads every sequence to the longest context of the batch; contexts longer than this many times the median
# (and than MIN_OUTLIER_CONTEXT) run on their own instead: one 1500-token context among 18 of 200 cost 5.4 ms a layer
# padded and under 1 ms apart.
OUTLIER_FACTOR, MIN_OUTLIER_CONTEXT = 2, 256


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """query: [num_seqs, num_heads, head_dim], one token per sequence (the last position) -> same shape."""
    out = native_attention.decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)
    if out is not None:
        return out
    return decode_by_gather(query, k_cache, v_cache, block_tables, context_lens, scale, max_context_len)


# paged_attention_decode's signature again: the torch path on its own, the definition the native kernel is tested against
def decode_by_gather(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """paged_attention_decode in torch: each sequence's blocks gathered out of the cache, then SDPA (padded to the
    longest context of the batch, outliers on their own)."""
    if query.shape[0] == 1:
        return decode_one_sequence(query, k_cache, v_cache, block_tables, int(context_lens[0]), scale)
    lens = context_lens.tolist()
    cut = max(OUTLIER_FACTOR * sorted(lens)[len(lens) // 2], MIN_OUTLIER_CONTEXT)
    if max(lens) <= cut:
        return padded_decode(
            query, k_cache, v_cache, block_tables, context_lens, scale, max_context_len or max(lens)
        )
    out = torch.empty_like(query)
    rest = [i for i, n in enumerate(lens) if n <= cut]
    for i, n in enumerate(lens):
        if n > cut:
            out[i : i + 1] = decode_one_sequence(
                query[i : i + 1], k_cache, v_cache, block_tables[i : i + 1], n, scale
            )
    if rest:
        idx = torch.tensor(rest, device=query.device)
        out[idx] = padded_decode(
            query[idx],
            k_cache,
            v_cache,
            block_tables[idx],
            context_lens[idx],
            scale,
            max(lens[i] for i in rest),
        )
    return out


def padded_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
) -> torch.Tensor:
    """paged_attention_decode with every sequence padded to max_context_len (masked): one SDPA for the batch."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    k = gather_kv(k_cache, block_tables, max_context_len).transpose(1, 2)  # [S, Hkv, L, D]
    v = gather_kv(v_cache, block_tables, max_context_len).transpose(1, 2)
    valid = torch.arange(max_context_len, device=query.device)[None, :] < context_lens[:, None]
    # GQA without repeating K/V: the query heads sharing a kv head become that head's query rows
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).to(k.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def decode_one_sequence(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """paged_attention_decode of a single sequence: nothing to pad or mask, and two batched matmuls with a softmax
    in float32 cost about half of SDPA's CPU kernel with its mask at this size (batch-1 decode, per layer)."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    k = gather_kv(k_cache, block_tables[:1], context_len)[0]  # [L, Hkv, D]
    v = gather_kv(v_cache, block_tables[:1], context_len)[0]
    q = query.reshape(num_kv_heads, num_heads // num_kv_heads, head_dim)  # GQA: a kv head's query rows
    if not q.dtype == k.dtype == torch.float32:  # float32 math whatever the cache holds
        q, k, v = q.float(), k.float(), v.float()
    probs = torch.bmm(q, k.permute(1, 2, 0)).mul_(scale).softmax(-1)  # [Hkv, G, L]
    out = torch.bmm(probs, v.transpose(0, 1)).view(1, num_heads, head_dim)
    return out if out.dtype == query.dtype else out.to(query.dtype)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim], chunks of several sequences back to back.

    Chunk i holds the last q_len_i positions of a sequence whose cache has context_lens[i] tokens (earlier
    chunks and prefix-cache hits included; this chunk's K/V already stored). Causal: query j of the chunk sees
    keys 0 .. context_len - q_len + j.
    """
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        q0, q1 = starts[i], starts[i + 1]
        native = native_attention.prefill_attention(
            query[q0:q1], k_cache, v_cache, block_tables[i], ctx, scale
        )
        if native is not None:
            out[q0:q1] = native
            continue
        k = gather_kv(k_cache, block_tables[i : i + 1], ctx)[0]  # [L, Hkv, D]
        v = gather_kv(v_cache, block_tables[i : i + 1], ctx)[0]
        out[q0:q1] = causal_attention(query[q0:q1], k, v, ctx - (q1 - q0), scale)
    return out


# Query rows per block of scores: small blocks stay in cache and skip the keys the causal mask hides.
# On CPU this is 2-4x faster than F.scaled_dot_product_attention for prompts of 128-1500 tokens.
Q_BLOCK = 64


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float
) -> torch.Tensor:
    """q [Lq, H, D] at positions first_pos.., k/v [L, Hkv, D] at positions 0..; float32 math -> q's dtype."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    k_t = k.float().permute(1, 2, 0)  # [Hkv, D, L]: the matmul reads the transposed layout as it is
    v_f = v.float().transpose(0, 1)  # [Hkv, L, D]
    if q_len > Q_BLOCK:  # read once per block of queries: worth one contiguous copy
        v_f = v_f.contiguous()
    # GQA without repeating K/V: a kv head's query heads are stacked as extra query rows
    q_g = q.float().reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, Lq, D]
    out = torch.empty(num_kv_heads, group, q_len, head_dim, device=q.device)
    for s0 in range(0, q_len, Q_BLOCK):
        n = min(Q_BLOCK, q_len - s0)
        keys = first_pos + s0 + n  # what the block's last query may see
        scores = torch.matmul(
            q_g[:, :, s0 : s0 + n].reshape(num_kv_heads, group * n, head_dim), k_t[:, :, :keys]
        )
        scores = scores.view(num_kv_heads, group, n, keys).mul_(scale)
        # every query sees the keys before the block's first one: only the last n columns need a mask
        if n > 1:
            hidden = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
            scores[..., keys - n :].masked_fill_(hidden, float("-inf"))
        probs = scores.softmax(-1)
        out[:, :, s0 : s0 + n] = torch.matmul(probs.view(num_kv_heads, group * n, keys), v_f[:, :keys]).view(
            num_kv_heads, group, n, head_dim
        )
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(q.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual) normalised; returns (normed, new residual) so layers can chain the fused form.
    Rounds like transformers' RMSNorm: normalise in float32, cast to x's dtype, then multiply by the weight.
    float32 or bfloat16 on CPU: one pass of the native kernel (F.rms_norm is eight small ops here)."""
    if x.dtype == weight.dtype:
        fused = cpu_native.add_rms_norm(x, weight, eps, residual)
        if fused is not None:
            return fused
    if residual is not None:
        x = x + residual
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one fused op, same values
        return F.rms_norm(x, x.shape[-1:], weight, eps), x
    return F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype) * weight, x


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (half-split) rotary as in HF Llama. query: [N, H, D], key: [N, Hkv, D];
    cos_sin_cache: [max_pos, D] = cat(cos[:, :D/2], sin[:, :D/2]) in float32."""
    both = torch.cat((query, key), dim=1)  # one pass over q and k: half the ops at decode sizes
    out = apply_rotary(both, *rotary_tables(positions, cos_sin_cache))
    return out[:, : query.shape[1]], out[:, query.shape[1] :]


def rotary_tables(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of `positions` as full-width [N, 1, D] cos and sign-folded sin, so that rotating x is
    x * cos + swap_halves(x) * sin. The model builds them once per step for all its layers."""
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D] (q's and k's heads side by side) rotated by rotary_tables' cos/sin; float32 math.
    The same values as x1 * cos - x2 * sin | x2 * cos + x1 * sin (negation and a + (-b) are exact)."""
    xf = x if x.dtype == torch.float32 else x.float()
    half = x.shape[-1] // 2
    out = (xf * cos).add_(torch.cat((xf[..., half:], xf[..., :half]), dim=-1).mul_(sin))
    return out if out.dtype == x.dtype else out.to(x.dtype)
