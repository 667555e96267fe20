"""Random paged-cache layouts for the Triton kernel tests: shuffled block tables that never use block 0 (the
table padding value, filled with garbage so reading past a context shows), optional shared prefix blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class PagedCase:
    k_cache: torch.Tensor  # [num_blocks, page, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    context_lens: torch.Tensor  # [S] int32


def paged_case(
    context_lens: list[int],
    page: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    shared_prefix_blocks: int = 0,
    seed: int = 0,
) -> PagedCase:
    """Sequences 0 and 1 share their first `shared_prefix_blocks` physical blocks (a prefix-cache hit)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // page) for n in context_lens]
    total = sum(needed) + 1
    ids = (torch.randperm(total - 1, generator=gen) + 1).tolist()
    width = max(needed) + 1  # one extra padded column, as the runner's tables have
    tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    if shared_prefix_blocks:
        assert min(needed[0], needed[1]) > shared_prefix_blocks
        tables[1, :shared_prefix_blocks] = tables[0, :shared_prefix_blocks]
    shape = (total, page, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    k[0], v[0] = 1e4, -1e4  # the padding block: garbage that would dominate any result that reads it
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return PagedCase(k.to(DEVICE), v.to(DEVICE), tables.to(DEVICE), lens.to(DEVICE))


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
