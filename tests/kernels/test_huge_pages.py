"""Packed weights and the CPU KV cache on memory advised for transparent huge pages (kernels/huge_pages.py)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from llmdeploy.kernels import huge_pages
from llmdeploy.kernels.cpu_native import f32_pack
from llmdeploy.kernels.huge_pages import huge_empty, huge_zeros
from llmdeploy.kernels.native_quant import QFormat, q_pack, q_unpack

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_offered() -> bool:
    """Whether this kernel gives huge pages to advised memory at all (the bracketed mode is not 'never')."""
    return THP_MODE.exists() and "[never]" not in THP_MODE.read_text()


def mapping_fields(ptr: int) -> dict[str, str]:
    """/proc/self/smaps' fields of the mapping that holds address ptr."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= ptr < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_tensors_are_aligned_disjoint_writable_and_outlive_their_arena():
    tensors = [
        huge_empty(n, dt) for n, dt in [(1000, torch.bfloat16), (7, torch.float32), (4097, torch.uint8)]
    ]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    assert all(t.data_ptr() % huge_pages.ALIGN == 0 and t.is_contiguous() for t in tensors)
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    huge_pages._arena.mapping = None  # the arena moves on; the tensors keep their mapping alive
    big = huge_empty(huge_pages.CHUNK, torch.uint8)  # larger than a chunk's share: its own mapping
    big.fill_(9)
    gc.collect()
    assert [float(t.float().mean()) for t in tensors] == [1.0, 2.0, 3.0] and int(big[-1]) == 9
    assert huge_empty(0, torch.float32).shape == (0,)


def test_zeros_are_zero_and_lazily_sized():
    z = huge_zeros(3 * 1024 * 1024 + 5, torch.bfloat16)
    assert z.numel() == 3 * 1024 * 1024 + 5 and z.dtype == torch.bfloat16 and not z.any()
    z[-1] = 2.0
    assert float(z.sum()) == 2.0


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_packed_weights_and_cache_sit_on_memory_advised_for_huge_pages():
    # q_pack runs on every CPU (portable kernel); f32_pack where AVX-512 is: both take the arena's memory
    q = torch.randint(-127, 128, (64, 64), dtype=torch.int8)
    d = torch.rand(64, 2, dtype=torch.float16) + 0.5
    packed = q_pack(QFormat.Q8, q, d, None)
    assert packed is not None and torch.equal(
        q_unpack(packed), q.float() * d.float().repeat_interleave(32, 1)
    )
    cache = huge_zeros(1 << 20, torch.float32)
    f32 = f32_pack(torch.randn(48, 64))
    for t in [packed.data, cache] + ([f32] if f32 is not None else []):
        fields = mapping_fields(t.data_ptr())
        # MADV_HUGEPAGE took (a kernel built without THP refuses it: ordinary memory, no flag)
        assert ("hg" in fields["VmFlags"].split()) == THP_MODE.exists(), fields
        if "THPeligible" in fields:
            assert fields["THPeligible"] == ("1" if thp_offered() else "0"), fields
