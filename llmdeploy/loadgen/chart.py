"""`--chart OUT.png | OUT.html`: load vs throughput and latency, with the SLA targets drawn as lines.

Drawn with matplotlib's object API on the Agg canvas (no pyplot, no display, no global state). The HTML form is
one self-contained file: the same figure as inline SVG plus a table of the figures; nothing is fetched.
"""

from __future__ import annotations

import html
import io
from pathlib import Path
from typing import Any

BACKEND_COLORS = {"local": "#1f77b4", "cloud": "#ff7f0e", "unknown": "#7f7f7f"}


class ChartError(ValueError):
    """The chart path has a suffix bench cannot draw."""


def chart_kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in (".png", ".html", ".htm"):
        raise ChartError(f"--chart {path}: the file must end in .png or .html")
    return "png" if suffix == ".png" else "html"


def _figure(report: dict[str, Any]):
    from matplotlib.figure import Figure

    levels, sla, burst = report["levels"], report["sla"], report.get("burst")
    rows = 2 if burst else 1
    fig = Figure(figsize=(15, 4.6 * rows), layout="constrained")
    grid = fig.add_gridspec(rows, 3)
    axes = [[fig.add_subplot(grid[0, i]) for i in range(3)]]
    mode = report["load"]["mode"]
    xlabel = "concurrency (requests in flight)" if mode == "concurrency" else "arrival rate (requests/s)"
    xs = list(range(len(levels)))
    ticks = [f"{lv['value']:g}" for lv in levels]
    best = (report.get("verdict") or {}).get("highest_passing")
    best_x = next((i for i, lv in enumerate(levels) if best and lv["value"] == best["value"]), None)

    tp = axes[0][0]
    tp.plot(xs, [lv["output_tokens_per_s"] for lv in levels], "o-", label="output tokens/s")
    tp.set_ylabel("output tokens/s")
    rq = tp.twinx()
    rq.plot(xs, [lv["requests_per_s"] for lv in levels], "s--", color="#2ca02c", label="requests/s")
    rq.set_ylabel("requests/s")
    tp.set_ylim(bottom=0)
    rq.set_ylim(bottom=0)
    tp.set_title("throughput")
    tp.legend(loc="upper left", fontsize=8)
    rq.legend(loc="lower right", fontsize=8)

    _latency(axes[0][1], xs, levels, "ttft_ms", ("p50", "p90", "p99"), sla.get("ttft_p99_ms"), "TTFT")
    _latency(axes[0][2], xs, levels, "tpot_ms", ("p50", "p99"), sla.get("tpot_p99_ms"), "TPOT")
    for ax in axes[0]:
        ax.set_xticks(xs, ticks)
        ax.set_xlabel(xlabel)
        if best_x is not None:
            ax.axvline(best_x, color="green", linestyle=":", linewidth=1)
        if best_x is not None and ax is axes[0][1]:
            ax.annotate(
                "highest load meeting the SLA",
                (best_x, 0),
                xytext=(3, 3),
                textcoords="offset points",
                rotation=90,
                fontsize=7,
                color="green",
                va="bottom",
            )
    if burst:
        _burst(fig.add_subplot(grid[1, :]), burst)
    target = report["target"]
    fig.suptitle(
        f"llmdeploy bench: {target['model']} at {target['url']}  -  {report['verdict']['summary']}",
        fontsize=10,
    )
    return fig


def _latency(ax, xs, levels, key: str, quantiles: tuple[str, ...], target: float | None, name: str) -> None:
    for q in quantiles:
        ys = [lv[key][q] for lv in levels]
        if any(y is not None for y in ys):
            ax.plot(xs, [float("nan") if y is None else y for y in ys], "o-", label=f"{name} {q}")
    if target is not None:
        ax.axhline(target, color="red", linestyle="--", label=f"SLA {name} p99 {target:g} ms")
    ax.set_ylabel(f"{name} (ms)")
    ax.set_title(f"{name}" + ("" if target is not None else " (no SLA target)"))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)


def _burst(ax, burst: dict[str, Any]) -> None:
    ax.axvspan(burst["burst_start_s"], burst["burst_end_s"], color="#ffdd99", alpha=0.5, label="burst")
    failed_y = burst["ttft_target_ms"] * 1.5
    for backend, color in BACKEND_COLORS.items():
        pts = [
            (t, ttft)
            for t, ttft, b, ok, _ in burst["timeline"]
            if ok and ttft is not None and (b if b in BACKEND_COLORS else "unknown") == backend
        ]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=8, color=color, label=f"TTFT, {backend}")
    failed = [t for t, _, _, ok, _ in burst["timeline"] if not ok]
    if failed:
        ax.scatter(failed, [failed_y] * len(failed), marker="x", color="black", label="rejected / failed")
    ax.axhline(
        burst["ttft_target_ms"],
        color="red",
        linestyle="--",
        label=f"SLA TTFT p99 {burst['ttft_target_ms']:g} ms",
    )
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("TTFT (ms)")
    title = f"burst {burst['factor']:g}x of {burst['base_rate']:.3g}/s for {burst['duration_s']:g} s"
    rec = burst.get("recovery_s")
    ax.set_title(
        title + (f"; TTFT recovered {rec:.1f} s after" if rec is not None else "; TTFT did not recover")
    )
    ax.legend(fontsize=8, loc="upper right")


def write_chart(report: dict[str, Any], path: Path) -> None:
    kind = chart_kind(path)
    fig = _figure(report)
    if kind == "png":
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
        fig.savefig(path, format="png", dpi=110)
        return
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    svg = buf.getvalue()
    path.write_text(_html(report, svg[svg.index("<svg") :]), encoding="utf-8")


def _html(report: dict[str, Any], svg: str) -> str:
    e = html.escape
    head = ["load", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p99", "e2e p99", "success", "SLA"]
    rows = []
    for lv in report["levels"]:
        cells = [
            f"{lv['mode']} {lv['value']:g}",
            f"{lv['requests_per_s']:.2f}",
            f"{lv['output_tokens_per_s']:.1f}",
            _ms(lv["ttft_ms"]["p50"]),
            _ms(lv["ttft_ms"]["p99"]),
            _ms(lv["tpot_ms"]["p99"]),
            _ms(lv["e2e_ms"]["p99"]),
            "-" if lv["success_rate"] is None else f"{lv['success_rate']:.1%}",
            "meets" if lv["meets_sla"] else "misses: " + "; ".join(lv["sla_misses"]),
        ]
        rows.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>")
    t = report["target"]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>llmdeploy bench: {e(t['model'])}</title>"
        "<style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}td:first-child{text-align:left}"
        "svg{max-width:100%;height:auto}</style></head><body>\n"
        f"<h1>llmdeploy bench: {e(t['model'])} at {e(t['url'])}</h1>\n"
        f"<p>{e(report['started_at'])}. Verdict: {e(report['verdict']['summary'])}</p>\n{svg}\n"
        "<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>\n" + "\n".join(rows) + "</table>\n"
        "</body></html>\n"
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"
