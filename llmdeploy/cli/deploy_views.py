"""Rich rendering for the deployment commands (status, history, the apply summary). Pure: dicts in, tables out."""

from __future__ import annotations

import json
import time
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from llmdeploy.cli.observe_views import bench_line, cost_line, memory_cell
from llmdeploy.control import revisions as rv
from llmdeploy.control.diff import diff_specs

STATE_STYLE = {
    rv.STARTING: "yellow",
    rv.READY: "cyan",
    rv.SERVING: "green",
    rv.RETIRED: "dim",
    rv.FAILED: "red",
    rv.ROLLED_BACK: "magenta",
}


def ago(ts: float | None) -> str:
    if not ts:
        return "-"
    s = max(0.0, time.time() - ts)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


def phase_line(rep: dict[str, Any]) -> str:
    kv = f"KV cache {rep['kv_tokens']:,} tokens" if rep.get("kv_tokens") else None
    phase = rep["phase"]
    detail = f" ({kv})" if kv and phase in ("warming up", "ready") else ""
    return f"revision {rep['revision']} {rep['replica']}: {phase}{detail}"


def curl_line(st: dict[str, Any], key_env: str | None) -> str:
    body = json.dumps({"model": st["served_alias"], "messages": [{"role": "user", "content": "Hello!"}]})
    auth = f' -H "Authorization: Bearer ${key_env or "LLMDEPLOY_API_KEY"}"' if st.get("auth") else ""
    return f"curl {st['url']}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


def summary_table(st: dict[str, Any]) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    split = st.get("split", {})
    revs = [f"{st['stable']} (stable, {split.get(str(st['stable']), 0):g}%)"] if st.get("stable") else []
    if st.get("candidate"):
        revs.append(f"{st['candidate']} (candidate, {split.get(str(st['candidate']), 0):g}%)")
    live = [r for r in st["replicas"] if r["revision"] in (st.get("stable"), st.get("candidate"))]
    t.add_row("URL", f"{st['url']}/v1")
    t.add_row("served alias", st["served_alias"] or "-")
    t.add_row("revision", ", ".join(revs) or "-")
    t.add_row("replicas", f"{sum(r['ready'] for r in live)}/{len(live)} ready{range_note(st)}")
    t.add_row("cloud", "on" if st.get("cloud") else "off")
    t.add_row("auth", "API key required" if st.get("auth") else "none (loopback only)")
    return t


def range_note(st: dict[str, Any]) -> str:
    """' (1-4)' when the stable revision autoscales, else ''."""
    scaling = st.get("autoscale")
    return f" ({scaling['min']}-{scaling['max']})" if scaling else ""


def scaling_line(scaling: dict[str, Any]) -> str:
    """e.g. '2 (1-4); last decision: hold: steady: requests are queued'."""
    d = scaling.get("decision")
    last = f"; last decision: {d['action']}: {d['reason']}" if d else ""
    return f"{scaling['replicas']} ({scaling['min']}-{scaling['max']}){last}"


def revisions_table(st: dict[str, Any]) -> Table:
    t = Table(title="Revisions", title_justify="left", show_edge=False)
    for col in ("REV", "STATE", "ROLE", "TRAFFIC", "CREATED", "ORIGIN", "MODEL", "NOTE"):
        t.add_column(col, overflow="fold")
    shown = [
        r
        for i, r in enumerate(st["revisions"])
        if r["state"] in rv.LIVE_STATES or i >= len(st["revisions"]) - 8
    ]
    for r in shown:  # the live ones and the recent history; `llmdeploy history` has all
        live = r["state"] in rv.LIVE_STATES
        t.add_row(
            str(r["id"]),
            Text(r["state"], style=STATE_STYLE.get(r["state"], "")),
            r.get("role") or "",
            f"{r['percent']:g}%" if r.get("role") else "",
            ago(r["created"]),
            r["origin"],
            r["model"] if live else Text(r["model"], style="dim"),
            r.get("reason") or "",
        )
    return t


def replicas_table(st: dict[str, Any]) -> Table:
    t = Table(title="Replicas", title_justify="left", show_edge=False)
    identity = ("REV", "REPLICA", "PID", "PORT", "HEALTH", "DTYPE")
    cols = (*identity, "RESTARTS", "STARTED IN", "KV USED", "WAITING", "RUNNING", "MEMORY")
    for col in cols:
        t.add_column(col, overflow="fold" if col == "MEMORY" else "ellipsis")
    for r in st["replicas"]:
        health = Text(r["phase"], style="green" if r["ready"] else "yellow" if not r.get("failed") else "red")
        kv = f"{r['kv_usage']:.0%}" if r.get("kv_usage") is not None else "-"
        t.add_row(
            str(r["revision"]),
            r["replica"],
            str(r["pid"] or "-"),
            r["url"].rsplit(":", 1)[-1],
            health,
            dtype_cell(r),
            str(r["restarts"]),
            f"{r['start_s']:g} s" if r.get("start_s") is not None else "-",
            kv,
            _num(r.get("waiting")),
            _num(r.get("running")),
            memory_cell(r.get("resources")),
        )
    return t


def dtype_cell(r: dict[str, Any]) -> str:
    """float32, bfloat16, or e.g. float32+int8 (weights quantized); '-' before the engine answered."""
    dtype = r.get("dtype") or "-"
    quant = r.get("quantization")
    return f"{dtype}+{quant}" if quant and quant != "none" else dtype


def traffic_table(st: dict[str, Any]) -> Table:
    router = st.get("router") or {}
    t = Table(title="Traffic (router's sliding windows)", title_justify="left", show_edge=False)
    window = next((r["window"]["window_s"] for r in router.get("revisions", []) if r.get("window")), None)
    span = f" ({window:g}s)" if window else ""
    for col in ("REV", "ROLE", "SPLIT", f"REQUESTS{span}", "REQ/S", "ERROR RATE", "TTFT P50", "TTFT P99"):
        t.add_column(col)
    for r in router.get("revisions", []):
        w = r.get("window") or {}
        rate = w.get("requests", 0) / w["window_s"] if w.get("window_s") else 0.0
        ttft, p50 = (_ms(w.get(k)) for k in ("ttft_p99_ms", "ttft_p50_ms"))
        t.add_row(
            str(r["revision"]),
            r.get("role", ""),
            f"{r.get('percent', 0):g}%",
            str(w.get("requests", 0)),
            f"{rate:.2f}",
            f"{w.get('error_rate', 0):.1%}",
            p50,
            ttft,
        )
    return t


def events_table(events: list[dict[str, Any]]) -> Table:
    t = Table(title="Last events", title_justify="left", show_edge=False)
    for col in ("TIME", "EVENT", "REV", "MESSAGE"):
        t.add_column(col, overflow="fold")
    for e in events:
        style = "red" if e["kind"] in ("auto-rollback", "engine-crash", "engine-failed", "failed") else ""
        t.add_row(clock(e["ts"]), Text(e["kind"], style=style), str(e["revision"] or ""), e["message"])
    return t


def status_view(st: dict[str, Any]) -> RenderableType:
    daemon = st.get("daemon") or {}
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("deployment", st["name"])
    head.add_row(
        "daemon",
        f"running (pid {daemon['pid']})" if daemon.get("running") else daemon.get("note", "not running"),
    )
    if st.get("url"):
        head.add_row("URL", f"{st['url']}/v1" + ("" if st.get("listening") else "  (not listening)"))
        head.add_row("served alias", st.get("served_alias") or "-")
    split = ", ".join(f"rev {k}: {v:g}%" for k, v in (st.get("split") or {}).items()) or "-"
    head.add_row("traffic split", split)
    router = st.get("router") or {}
    if router:
        cloud = router.get("cloud") or {}
        reqs = router.get("requests") or {}
        head.add_row(
            "cloud",
            f"{'on' if cloud.get('enabled') else 'off'}; share {cloud.get('share', 0):.1%} "
            f"({reqs.get('cloud', 0)} of {reqs.get('local', 0) + reqs.get('cloud', 0)} requests); "
            f"breaker {cloud.get('breaker', '-')}",
        )
    else:
        source = f" ({st['settings_from']})" if st.get("settings_from") else ""
        head.add_row("cloud", ("on" if st.get("cloud") else "off") + source)
    for label, line in (("cost", cost_line(router.get("cost"))), ("bench", bench_line(st.get("bench")))):
        if line:
            head.add_row(label, line)
    if st.get("autoscale"):
        head.add_row("replicas", scaling_line(st["autoscale"]))
    judged = st.get("auto_rollback")
    if judged:
        head.add_row("auto-rollback", judged["reason"])
    last_rb = st.get("last_auto_rollback")
    if last_rb:
        head.add_row(
            "last auto-rollback", Text(f"{clock(last_rb['ts'])} {last_rb['message']}", style="magenta")
        )
    parts: list[RenderableType] = [head, Text(), revisions_table(st)]
    if st.get("replicas"):
        parts += [Text(), replicas_table(st)]
    if router.get("revisions"):
        parts += [Text(), traffic_table(st)]
    if st.get("events"):
        parts += [Text(), events_table(st["events"])]
    return Group(*parts)


def history_table(revisions: list[Any], stable: int | None, candidate: int | None) -> Table:
    t = Table(show_edge=False, expand=True)
    t.add_column("REV", no_wrap=True)
    t.add_column("STATE", no_wrap=True)
    t.add_column("CREATED", no_wrap=True)
    t.add_column("ORIGIN", no_wrap=True)
    t.add_column("CHANGE", ratio=1, overflow="fold")
    t.add_column("NOTE", ratio=1, overflow="fold")
    prev = None
    for r in revisions:
        role = " (stable)" if r.id == stable else " (candidate)" if r.id == candidate else ""
        t.add_row(
            str(r.id),
            Text(r.state + role, style=STATE_STYLE.get(r.state, "")),
            ago(r.created),
            r.origin,
            revision_change(prev, r.spec),
            r.reason,
        )
        prev = r.spec
    return t


def scaling_table(events: list[Any]) -> Table:
    """The autoscaler's changes (`scale` events of state.db), for `history`: when, which revision, the count
    before and after, and why."""
    t = Table(title="Scaling", title_justify="left", show_edge=False, expand=True)
    for col in ("TIME", "REV", "CHANGE", "REASON"):
        t.add_column(col, no_wrap=col != "REASON", ratio=1 if col == "REASON" else None, overflow="fold")
    for e in events:
        d = e.data or {}
        change = f"{d.get('from')} -> {d.get('to')}" + (
            f" ({d['replica']} drains)" if d.get("replica") else ""
        )
        t.add_row(f"{ago(e.ts)}", str(e.revision or ""), change, d.get("reason", e.message))
    return t


def revision_change(prev: dict | None, spec: dict) -> str:
    if prev is None:
        return f"model {spec['model']['path']}"
    changes = diff_specs(
        {k: prev[k] for k in rv.REVISION_SECTIONS}, {k: spec[k] for k in rv.REVISION_SECTIONS}
    ).changes
    return "; ".join(f"{c.path}: {c.old} -> {c.new}" for c in changes[:4]) or "same as previous"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


def _num(v: Any) -> str:
    return "-" if v is None else str(v)
