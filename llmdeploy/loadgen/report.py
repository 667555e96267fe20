"""bench's output: the terminal tables (rich) and the JSON document (every figure; `--compare` reads it back)."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from llmdeploy import __version__
from llmdeploy.loadgen.compare import Comparison
from llmdeploy.loadgen.session import BenchConfig, BenchRun
from llmdeploy.loadgen.stats import LevelSummary, Quantiles

FORMAT = 1


def report_dict(
    cfg: BenchConfig,
    run: BenchRun,
    comparison: Comparison | None,
    exit_code: int,
    started_at: dt.datetime,
    api_key_env: str | None,
) -> dict[str, Any]:
    return {
        "tool": "llmdeploy bench",
        "format": FORMAT,
        "version": __version__,
        "started_at": started_at.isoformat(timespec="seconds"),
        "target": {
            "url": cfg.url,
            "api_base": cfg.target.api_base,
            "model": cfg.target.model,
            "api_key_env": api_key_env,
        },
        "load": cfg.load_dict(),
        "sla": asdict(cfg.sla),
        "levels": [asdict(lv) for lv in run.levels],
        "verdict": run.verdict.to_dict(),
        "burst": run.burst,
        "compare": comparison.to_dict() if comparison else None,
        "metrics": run.metrics,
        "notes": run.notes,
        "exit_code": exit_code,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}")


def _qs(q: Quantiles, *names: str) -> str:
    return "/".join(_ms(getattr(q, n)) for n in names)


def _share(lv: LevelSummary) -> str:
    if not lv.share:
        return "-"
    return " ".join(f"{b} {s:.0%}" for b, s in sorted(lv.share.items(), key=lambda kv: -kv[1]))


def _server(lv: LevelSummary) -> str:
    s = lv.server
    if not s:
        return "absent"
    parts = []
    if s.get("kv_usage"):
        parts.append(f"KV {s['kv_usage']['max']:.0%}")
    if s.get("waiting"):
        parts.append(f"queue {s['waiting']['max']:.0f}")
    if s.get("router_inflight"):
        parts.append(f"in flight {s['router_inflight']['max']:.0f}")
    return ", ".join(parts) or "absent"


def _errors(lv: LevelSummary) -> str:
    return ", ".join(f"{k} x{n}" for k, n in lv.errors.items()) or "-"


def _sla(lv: LevelSummary) -> Text:
    if lv.meets_sla is None:
        return Text("-")
    if lv.meets_sla:
        return Text("meets", style="green")
    return Text("misses: " + "; ".join(lv.sla_misses), style="red")


def levels_tables(levels: list[LevelSummary], title: str) -> Group:
    """Two tables, so each fits a terminal: speed and latency, then who served what and how the server fared."""
    load = "rate/s" if levels and levels[0].mode == "rate" else "concurrency"
    speed = Table(title=title, title_justify="left")
    speed.add_column(load, justify="right", min_width=len(load))
    for col in ("req/s", "out tok/s", "TTFT ms\np50/p90/p99", "TPOT ms\np50/p99", "e2e ms\np50/p99"):
        speed.add_column(col, justify="right")
    speed.add_column("SLA")
    where = Table()
    for col in (load, "requests", "success", "errors", "served by", "server (sampled max)"):
        # fold, never crop: an error kind cut to "http_429:rate_li..." would hide the code
        where.add_column(
            col,
            justify="left" if col in ("errors", "served by", "server (sampled max)") else "right",
            overflow="fold",
        )
    for lv in levels:
        speed.add_row(
            f"{lv.value:g}",
            f"{lv.requests_per_s:.2f}",
            f"{lv.output_tokens_per_s:.1f}",
            _qs(lv.ttft_ms, "p50", "p90", "p99"),
            _qs(lv.tpot_ms, "p50", "p99"),
            _qs(lv.e2e_ms, "p50", "p99"),
            _sla(lv),
        )
        success = "-" if lv.success_rate is None else f"{lv.success_rate:.1%}"
        where.add_row(f"{lv.value:g}", str(lv.requests), success, _errors(lv), _share(lv), _server(lv))
    return Group(speed, where)


def burst_view(b: dict[str, Any]) -> RenderableType:
    t = Table(title=f"Burst drill: {b['factor']:g}x for {b['duration_s']:g} s", title_justify="left")
    outcomes = b["outcomes"].values()
    # a router never answers "unknown", another server never "local"/"cloud": show the columns that happened
    served = [
        k
        for k in ("local_on_time", "local_late", "cloud", "unknown_on_time", "unknown_late")
        if any(o[k] for o in outcomes)
    ] or ["local_on_time"]
    for c in ("phase", "arrivals", *(k.replace("_", " ") for k in served), "rejected", "failed"):
        t.add_column(c, justify="left" if c == "phase" else "right")
    for phase in ("before", "burst", "after"):
        o, rej = b["outcomes"][phase], b["rejected_by_status"][phase]
        rejected = str(o["rejected"]) + (
            f" ({', '.join(f'{k}: {v}' for k, v in rej.items())})" if rej else ""
        )
        t.add_row(phase, str(b["arrivals"][phase]), *(str(o[k]) for k in served), rejected, str(o["failed"]))
    lines = [
        f"sustainable rate {b['base_rate']:.3g}/s: {b['base_rate_reason']}",
        f"burst at {b['burst_rate']:.3g}/s: {b['arrivals']['burst']} arrivals, {b['excess']:.0f} above the "
        f"{b['expected_at_base_rate']:.0f} the sustainable rate brings; late = TTFT over {b['ttft_target_ms']:g} ms",
        (
            f"TTFT recovered {b['recovery_s']:.1f} s after the burst ended"
            if b["recovered"]
            else f"TTFT not back under {b['ttft_target_ms']:g} ms within {b['after_s']:g} s after the burst"
        )
        + f" (p99 of the next {b['rolling_window_s']:.1f} s of arrivals)",
    ]
    return Group(t, *(Text(line) for line in lines))


def compare_table(c: Comparison, baseline_name: str) -> Table:
    t = Table(title=f"Against {baseline_name} (tolerance {c.tolerance:.0%})", title_justify="left")
    for col in ("load", "figure", "baseline", "now", "change", ""):
        t.add_column(col, justify="left" if col in ("load", "figure", "") else "right")
    for ch in c.changes:
        if ch.change is None:
            change = "-" if ch.direction == "n/a" else "from 0"
        elif ch.figure == "success rate":
            change = f"{ch.change * 100:+.1f} pt"
        else:
            change = f"{ch.change:+.1%}"
        mark = (
            Text("REGRESSION", style="bold red")
            if ch.regression
            else Text(ch.direction, style="green" if ch.direction == "better" else "")
        )
        fmt = (lambda v: "-" if v is None else f"{v:.1%}") if ch.figure == "success rate" else _num
        t.add_row(ch.level, ch.figure, fmt(ch.baseline), fmt(ch.current), change, mark)
    return t


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"
