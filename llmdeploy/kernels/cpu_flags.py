"""What /proc/cpuinfo says about this CPU, as the kernel builds, the dtype choice and the benchmarks read it."""

from __future__ import annotations

from pathlib import Path


def cpuinfo_lines(*prefixes: str) -> list[str]:
    """The lines of /proc/cpuinfo (every processor's) that start with one of `prefixes`; none where it cannot be
    read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return [line for line in text.splitlines() if line.startswith(prefixes)]


def cpu_model() -> str | None:
    """The first processor's model name, None where /proc/cpuinfo has none."""
    return next((line.partition(":")[2].strip() for line in cpuinfo_lines("model name")), None)


def cpu_flags() -> set[str]:
    """The first processor's flags ("Features" on Arm), empty where they cannot be read."""
    line = next(iter(cpuinfo_lines("flags", "Features")), "")
    return set(line.partition(":")[2].split())
