"""Status cells for the observability figures: memory watermarks, cost, the saved bench curve; and the
`status --watch` frame around the status view. Pure: dicts in, text out."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

GIB = 1024**3
MIB = 1024**2


def size(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def memory_cell(resources: dict[str, Any] | None) -> str:
    """'RSS 512 MiB (peak 540 MiB)' and on CUDA ' | GPU 3.1 GiB of 80.0 GiB (peak 3.4 GiB), util 45%'."""
    if not resources:
        return "-"
    text = f"RSS {size(resources.get('rss_bytes'))} (peak {size(resources.get('peak_rss_bytes'))})"
    if resources.get("device") == "cuda" and resources.get("device_memory_bytes") is not None:
        text += (
            f" | GPU {size(resources['device_memory_bytes'])} of {size(resources.get('device_memory_total_bytes'))}"
            f" (peak {size(resources.get('device_peak_memory_bytes'))})"
        )
        if resources.get("gpu_utilization") is not None:
            text += f", util {resources['gpu_utilization']:.0%}"
    return text


def money(value: float | None, currency: str) -> str:
    return "-" if value is None else f"{value:,.4g} {currency}"


def cost_line(cost: dict[str, Any] | None) -> str | None:
    """Per 1M tokens (input + output) local vs cloud over the last hour, and the spill's cost hour/day."""
    if not cost:
        return None
    c = cost["currency"]
    return (
        f"per 1M tokens: local {money(cost.get('local_per_1m'), c)}, cloud {money(cost.get('cloud_per_1m'), c)}; "
        f"spill to the cloud: {money(cost.get('spill_last_hour'), c)} last hour, "
        f"{money(cost.get('spill_last_day'), c)} last day"
    )


def bench_line(bench: dict[str, Any] | None) -> str | None:
    if not bench or not bench.get("levels"):
        return None
    points = ", ".join(
        f"{lv['value']:g}: {lv.get('output_tokens_per_s') or 0:.0f} tok/s, TTFT p99 "
        + (f"{lv['ttft_p99_ms']:.0f} ms" if lv.get("ttft_p99_ms") is not None else "-")
        for lv in bench["levels"]
    )
    return f"{bench.get('file')} ({bench.get('mode')}) {points}"


def watch_frame(view: RenderableType, error: str | None = None) -> RenderableType:
    stamp = time.strftime("%H:%M:%S")
    head = Text(f"llmdeploy status --watch   {stamp}   refreshing every 1 s, Ctrl-C to leave", style="dim")
    parts: list[RenderableType] = [head]
    if error:
        parts.append(Text(error, style="red"))
    return Group(*parts, Text(), view)
