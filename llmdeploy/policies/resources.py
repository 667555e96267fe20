"""What one engine process holds of the machine: the value its /load carries under `resources` (the engine
measures it in llmdeploy/engine/resources.py; the router, status and the dashboard read it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Device = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class ResourceUsage:
    rss_bytes: int = 0  # resident memory of the engine process now
    peak_rss_bytes: int = 0  # its high-water mark since the process started
    host_memory_total_bytes: int = 0
    device: Device = "cpu"
    # CUDA only: the caching allocator's reserved bytes (what the GPU sees as used) and their peak
    device_memory_bytes: int | None = None
    device_peak_memory_bytes: int | None = None
    device_memory_total_bytes: int | None = None
    gpu_utilization: float | None = None  # 0..1, from NVML where nvidia-ml-py is installed

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> ResourceUsage | None:
        """None for an engine that does not report it (an older one) or a malformed value."""
        if not isinstance(raw, dict):
            return None
        try:
            ints = ("device_memory_bytes", "device_peak_memory_bytes", "device_memory_total_bytes")
            return cls(
                rss_bytes=int(raw.get("rss_bytes") or 0),
                peak_rss_bytes=int(raw.get("peak_rss_bytes") or 0),
                host_memory_total_bytes=int(raw.get("host_memory_total_bytes") or 0),
                device="cuda" if raw.get("device") == "cuda" else "cpu",
                **{k: None if raw.get(k) is None else int(raw[k]) for k in ints},
                gpu_utilization=None if raw.get("gpu_utilization") is None else float(raw["gpu_utilization"]),
            )
        except (TypeError, ValueError):
            return None
