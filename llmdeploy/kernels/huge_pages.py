"""Packed weights and the CPU KV cache on transparent huge pages.

Batch-1 decode streams every weight once per token. On 4 KiB pages that is a TLB miss per 4 KiB read, and the
page walks cost the GEMV about 12% of its bandwidth against a plain read of the same bytes (AMD EPYC Zen 4,
2026-12-04: bf16 GEMVs over SmolLM2's 269 MB took 1.12-1.19x the time of a 2-thread sum of as many bytes on small
pages, 1.03-1.06x on huge ones, in alternating pairs). Linux gives anonymous memory huge pages only where it is
asked to (`transparent_hugepage/enabled` is `madvise` on most distributions), and torch's allocator does not
ask, so the native packs take their buffers from here: anonymous mappings advised MADV_HUGEPAGE, carved into
tensors by a bump allocator. A tensor keeps its mapping alive (torch.frombuffer holds the buffer), so a mapping
goes away with the last weight in it. Where huge pages are off or unsupported this is ordinary memory.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from dataclasses import dataclass, field

import torch

HUGE_PAGE = 2 << 20
CHUNK = 32 * HUGE_PAGE  # most projections share a mapping; larger tensors get their own
ALIGN = 64  # the kernels' vector loads want cache-line aligned tiles


def _advised_mapping(nbytes: int) -> mmap.mmap:
    # private: a shared anonymous mapping is shmem, which THP leaves alone (shmem_enabled)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # not Linux, or THP compiled out: small pages, same behaviour
    with contextlib.suppress(AttributeError, OSError):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


@dataclass
class _Arena:
    mapping: mmap.mmap | None = None
    used: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, nbytes: int) -> tuple[mmap.mmap, int]:
        with self.lock:
            if nbytes > CHUNK // 4:
                return _advised_mapping(nbytes), 0
            start = -(-self.used // ALIGN) * ALIGN
            if self.mapping is None or start + nbytes > len(self.mapping):
                self.mapping, start = _advised_mapping(CHUNK), 0
            self.used = start + nbytes
            return self.mapping, start


_arena = _Arena()


def _view(mapping: mmap.mmap, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset)


def huge_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of `numel` elements whose memory may sit on transparent huge pages."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return _view(*_arena.take(numel * dtype.itemsize), numel, dtype)


def huge_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D CPU tensor on a mapping of its own, faulted in (zero) as it is first touched, in huge pages
    where the kernel gives them: a large cache costs nothing at start and only its used part is resident."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return _view(_advised_mapping(numel * dtype.itemsize), 0, numel, dtype)
