"""The engine process's own resource watermarks: RSS now and at peak; on CUDA the allocator's memory and, where
nvidia-ml-py is installed, GPU utilisation. Read at most once a second (the router polls /load every 0.2 s)."""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
import time

from llmdeploy.policies.resources import ResourceUsage

CACHE_S = 1.0


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process, in bytes."""
    now, peak = _proc_status_kib("VmRSS"), _proc_status_kib("VmHWM")
    # ru_maxrss is KiB on Linux, bytes on macOS
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    peak_b = peak * 1024 if peak is not None else maxrss
    if now is None:
        try:
            import psutil  # installed with accelerate; only needed off Linux

            return int(psutil.Process().memory_info().rss), peak_b
        except Exception:  # no way to read it: report the peak as the current value
            return peak_b, peak_b
    return now * 1024, max(peak_b, now * 1024)


def trim_heap() -> bool:
    """Hands the C heap's free pages back to the system (glibc's malloc_trim(0)). Why: loading frees each layer's
    unpacked weights after packing them, and glibc keeps freed blocks under its mmap threshold (raised by the first
    large free, up to 32 MB) in the heap between live ones, where nothing returns them: SmolLM2-135M float32's engine
    held 1.64 GB resident after its start, 1.22 GB after this (Zen 3, 2026-12-07). Best effort: False where the C
    library has no malloc_trim (musl, macOS)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        return bool(ctypes.CDLL(None).malloc_trim(0))
    return False


def host_memory_total() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def host_memory_available() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def kv_cache_over_memory(gb: float) -> str | None:
    """Why a CPU KV cache of `gb` GiB cannot be had now (more than the machine's available memory), or None. The
    cache's pages are only committed as they fill: refused at start, not at the OOM killer."""
    available = host_memory_available()
    if available is not None and gb * (1 << 30) > available:
        return (
            f"engine.kv_cache_gb={gb} is more than this machine's available memory "
            f"({available / (1 << 30):.1f} GiB); lower engine.kv_cache_gb."
        )
    return None


def host_memory() -> tuple[int, int | None]:
    """(total, available) bytes of this machine; available is None off Linux."""
    return host_memory_total(), host_memory_available()


def _cuda(device) -> dict:
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    out = {
        "device_memory_bytes": int(torch.cuda.memory_reserved(idx)),
        "device_peak_memory_bytes": int(torch.cuda.max_memory_reserved(idx)),
        "device_memory_total_bytes": int(torch.cuda.get_device_properties(idx).total_memory),
    }
    # torch asks NVML (nvidia-ml-py), mapping CUDA_VISIBLE_DEVICES itself; without it: not reported
    with contextlib.suppress(Exception):
        out["gpu_utilization"] = float(torch.cuda.utilization(idx)) / 100.0
    return out


class ResourceMeter:
    """measure() -> ResourceUsage, cached for CACHE_S; `device` is the engine's torch.device (None: CPU)."""

    def __init__(self, device=None) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._last: tuple[float, ResourceUsage] | None = None

    def measure(self) -> ResourceUsage:
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last[0] < CACHE_S:
                return self._last[1]
            usage = self._read()
            self._last = (now, usage)
            return usage

    def _read(self) -> ResourceUsage:
        rss, peak = rss_bytes()
        cuda = getattr(self.device, "type", "cpu") == "cuda"
        extra: dict = {}
        if cuda:
            try:
                extra = _cuda(self.device)
            except Exception:  # a driver hiccup must not break /load
                extra = {}
        return ResourceUsage(
            rss_bytes=rss,
            peak_rss_bytes=peak,
            host_memory_total_bytes=host_memory_total(),
            device="cuda" if cuda else "cpu",
            **extra,
        )


_PROCESS = ResourceMeter()  # resources belong to the process: one meter, whichever part asks


def process_usage(device=None) -> ResourceUsage:
    """This process's usage; the engine passes its device once (load()), /metrics then reads the same meter."""
    if device is not None and _PROCESS.device != device:
        _PROCESS.device, _PROCESS._last = device, None
    return _PROCESS.measure()
