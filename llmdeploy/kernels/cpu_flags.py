"""The CPU's feature flags as the kernel paths and the dtype choice read them (one reader of /proc/cpuinfo)."""

from __future__ import annotations

from pathlib import Path


def cpu_flags() -> set[str]:
    """The flags of /proc/cpuinfo's first processor ("Features" on Arm), empty where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith(("flags", "Features"))), "")
    return set(line.partition(":")[2].split())
