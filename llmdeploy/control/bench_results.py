"""Saved bench results: `llmdeploy bench --save` writes its JSON report into the deployment's state folder
($LLMDEPLOY_HOME/<name>/bench/<UTC time>-<n>.json, names sort by time); `status` and the dashboard show the newest one's curve."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from llmdeploy.control.paths import DeploymentPaths

log = logging.getLogger("llmdeploy.control")
KEEP = 50  # older saved results are removed: the folder must not grow without bound


def bench_dir(paths: DeploymentPaths) -> Path:
    return paths.root / "bench"


def save_report(paths: DeploymentPaths, report: dict[str, Any]) -> Path:
    folder = bench_dir(paths)
    folder.mkdir(mode=0o700, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    same_second = sorted(folder.glob(f"{stamp}-*.json"))  # saves within one second keep their order
    n = int(same_second[-1].stem.rsplit("-", 1)[1]) + 1 if same_second else 1
    path = folder / f"{stamp}-{n:03d}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    for old in sorted(folder.glob("*.json"))[:-KEEP]:
        old.unlink(missing_ok=True)
    return path


def _q(level: dict[str, Any], figure: str, q: str) -> float | None:
    value = (level.get(figure) or {}).get(q)
    return float(value) if isinstance(value, (int, float)) else None


def curve(report: dict[str, Any], name: str) -> dict[str, Any]:
    """The figures the dashboard draws: per load level, throughput and latency, with the SLA lines."""
    levels = [
        {
            "value": lv.get("value"),
            "requests_per_s": lv.get("requests_per_s"),
            "output_tokens_per_s": lv.get("output_tokens_per_s"),
            "ttft_p50_ms": _q(lv, "ttft_ms", "p50"),
            "ttft_p99_ms": _q(lv, "ttft_ms", "p99"),
            "tpot_p99_ms": _q(lv, "tpot_ms", "p99"),
            "success_rate": lv.get("success_rate"),
            "meets_sla": lv.get("meets_sla"),
        }
        for lv in report.get("levels", [])
        if isinstance(lv, dict)
    ]
    sla = report.get("sla") or {}
    return {
        "file": name,
        "started_at": report.get("started_at"),
        "mode": report.get("load", {}).get("mode") or (report.get("levels") or [{}])[0].get("mode"),
        "levels": levels,
        "sla": {k: sla.get(k) for k in ("ttft_p99_ms", "tpot_p99_ms")},
        "verdict": (report.get("verdict") or {}).get("summary"),
        "cost": report.get("cost"),
    }


def latest_curve(paths: DeploymentPaths) -> dict[str, Any] | None:
    """The newest saved result's curve; None when none was saved (or the newest cannot be read)."""
    found = sorted(bench_dir(paths).glob("*.json"))
    if not found:
        return None
    try:
        return curve(json.loads(found[-1].read_text(encoding="utf-8")), found[-1].name)
    except (OSError, ValueError, AttributeError, TypeError) as e:
        log.warning("saved bench result %s is unreadable: %s", found[-1].name, e)
        return None
