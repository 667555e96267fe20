// llmdeploy dashboard: polls /dashboard/api/state every second and draws it. Plain JS, inline SVG charts,
// nothing loaded from elsewhere. Text from the server is always set as textContent, never parsed as HTML.
"use strict";

(() => {
  const KEY = "llmdeploy.dashboard.key";
  const POLL_MS = 1000;
  const KEEP_POINTS = 300; // replica history kept in the page: 5 minutes at one poll a second
  const COLORS = ["#2563eb", "#d97706", "#059669", "#db2777", "#7c3aed", "#0891b2", "#65a30d", "#dc2626"];
  const SVG = "http://www.w3.org/2000/svg";
  const authRequired = document.querySelector('meta[name="llmdeploy-auth"]').content === "required";
  const $ = (id) => document.getElementById(id);
  const replicaHistory = new Map(); // "rev/replica" -> [{t, kv, queue}]
  let timer = null;

  // ---- small helpers --------------------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
    return node;
  }
  function svgEl(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  }
  const fmtMs = (v) => (v == null ? "-" : v >= 100 ? `${v.toFixed(0)} ms` : `${v.toFixed(1)} ms`);
  const fmtPct = (v, digits = 1) => (v == null ? "-" : `${(v * 100).toFixed(digits)}%`);
  const fmtNum = (v) => (v == null ? "-" : Number(v).toLocaleString("en-US", { maximumFractionDigits: 1 }));
  const fmtBytes = (v) => (v == null ? "-" : v >= 2 ** 30 ? `${(v / 2 ** 30).toFixed(1)} GiB` : `${(v / 2 ** 20).toFixed(0)} MiB`);
  const fmtMoney = (v, cur) => (v == null ? "-" : `${v.toLocaleString("en-US", { maximumSignificantDigits: 4 })} ${cur}`);
  const clock = (ts) => new Date(ts * 1000).toLocaleTimeString("en-GB", { hour12: false });
  function fillBody(table, rows) {
    const body = table.tBodies[0];
    body.replaceChildren(...rows);
  }

  // ---- charts: one function draws every line chart ----------------------------------------------------------
  // series: [{name, color, points: [[x, y], ...]}]; opts: {xfmt, yfmt, xticks, xrange, ymax, hlines: [{y, label}]}
  function lineChart(svg, series, opts = {}) {
    const [W, H] = svg.getAttribute("viewBox").split(" ").slice(2).map(Number);
    const m = { l: 48, r: 10, t: 18, b: 22 };
    svg.replaceChildren();
    const pts = series.flatMap((s) => s.points.filter((p) => p[1] != null));
    const hl = opts.hlines || [];
    if (!pts.length) {
      const t = svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" });
      t.textContent = opts.empty || "no data yet";
      svg.append(t);
      return;
    }
    const xs = pts.map((p) => p[0]);
    const ys = pts.map((p) => p[1]).concat(hl.map((h) => h.y));
    let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
    if (opts.xrange) [x0, x1] = opts.xrange;
    if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
    const y0 = 0;
    let y1 = opts.ymax ?? Math.max(...ys) * 1.1;
    if (!(y1 > y0)) y1 = y0 + 1;
    const X = (x) => m.l + ((x - x0) / (x1 - x0)) * (W - m.l - m.r);
    const Y = (y) => H - m.b - ((y - y0) / (y1 - y0)) * (H - m.t - m.b);
    // ticks keep enough decimals to differ: 0, 0.37, 0.73, 1.1 rather than 0, 0, 1, 1
    const yfmt = opts.yfmt || ((v) => (y1 >= 30 ? fmtNum(Math.round(v)) : v.toFixed(y1 >= 3 ? 1 : 2)));
    for (let i = 0; i <= 3; i++) {
      const v = y0 + ((y1 - y0) * i) / 3;
      svg.append(svgEl("line", { class: "grid", x1: m.l, x2: W - m.r, y1: Y(v), y2: Y(v) }));
      const t = svgEl("text", { x: m.l - 4, y: Y(v) + 4, "text-anchor": "end" });
      t.textContent = yfmt(v);
      svg.append(t);
    }
    const xfmt = opts.xfmt || fmtNum;
    for (const x of opts.xticks || [x0, (x0 + x1) / 2, x1]) {
      const t = svgEl("text", { x: X(x), y: H - 6, "text-anchor": x === x0 ? "start" : x === x1 ? "end" : "middle" });
      t.textContent = xfmt(x);
      svg.append(t);
    }
    for (const h of hl) {
      svg.append(svgEl("line", { class: "sla", x1: m.l, x2: W - m.r, y1: Y(h.y), y2: Y(h.y) }));
      const t = svgEl("text", { x: W - m.r, y: Y(h.y) - 3, "text-anchor": "end" });
      t.textContent = h.label;
      svg.append(t);
    }
    let lx = m.l;
    series.forEach((s, i) => {
      const color = s.color || COLORS[i % COLORS.length];
      const valid = s.points.filter((p) => p[1] != null);
      if (valid.length) {
        const d = valid.map((p, j) => `${j ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ");
        svg.append(svgEl("path", { class: "series", d, stroke: color }));
        if (valid.length === 1) svg.append(svgEl("circle", { cx: X(valid[0][0]), cy: Y(valid[0][1]), r: 3, fill: color }));
      }
      const t = svgEl("text", { x: lx + 12, y: 11 });
      t.textContent = s.name;
      svg.append(svgEl("rect", { x: lx, y: 3, width: 9, height: 9, fill: color }), t);
      lx += 22 + 7 * s.name.length;
    });
  }

  // ---- the sections -----------------------------------------------------------------------------------------
  function renderRevisions(st) {
    const bar = $("split-bar");
    bar.replaceChildren();
    st.revisions.forEach((r, i) => {
      const part = el("div", { "data-revision": r.revision }, `rev ${r.revision} ${r.percent}%`);
      part.style.width = `${r.percent}%`;
      part.style.background = COLORS[i % COLORS.length];
      bar.append(part);
    });
    const stable = st.revisions.find((r) => r.role === "stable");
    $("current-revision").textContent = stable ? String(stable.revision) : "-";
    $("split-text").textContent = st.revisions.map((r) => `rev ${r.revision} (${r.role}) ${r.percent}%`).join(" · ") || "-";
    fillBody($("revisions"), st.revisions.map((r) =>
      el("tr", { "data-revision": r.revision, "data-percent": r.percent },
        el("td", {}, r.revision), el("td", {}, r.role), el("td", {}, r.state || "-"),
        el("td", { class: "num" }, `${r.percent}%`),
        el("td", { class: r.ready ? "good" : "warn" }, r.ready ? "yes" : "no"), el("td", {}, r.model || "-"))));
    const ar = st.auto_rollback;
    $("auto-rollback").textContent = ar ? `auto-rollback watch: ${ar.reason}` : "";
  }

  function renderCompare(st) {
    const revs = [...st.revisions].sort((a, b) => (a.role === "stable" ? -1 : 1) - (b.role === "stable" ? -1 : 1));
    const span = revs.length ? revs[0].span_s : null;
    $("compare-window").textContent = span ? `(last ${span} s, local answers)` : "";
    const head = $("compare").tHead;
    head.replaceChildren(el("tr", {}, el("th", {}, ""), ...revs.map((r) => el("th", {}, `rev ${r.revision} (${r.role})`))));
    const row = (label, f) => el("tr", {}, el("th", {}, label), ...revs.map((r) => el("td", { class: "num" }, f(r))));
    fillBody($("compare"), [
      row("requests", (r) => fmtNum(r.requests)),
      row("error rate", (r) => fmtPct(r.error_rate, 2)),
      row("TTFT p50", (r) => fmtMs(r.ttft_p50_ms)),
      row("TTFT p99", (r) => fmtMs(r.ttft_p99_ms)),
      row("traffic", (r) => `${r.percent}%`),
    ]);
    const pts = st.traffic.points;
    lineChart($("chart-ttft"), revs.map((r) => ({
      name: `rev ${r.revision} ${r.role}`,
      points: pts.map((p) => [p.t, p.ttft_p99_ms[String(r.revision)] ?? null]),
    })), { xfmt: clock, xrange: [pts[0].t, pts[pts.length - 1].t], empty: "no local answers yet" });
  }

  function renderTraffic(st) {
    const h = st.share_last_hour;
    const total = h.requests.local + h.requests.cloud;
    $("share").textContent = `last hour: ${fmtNum(h.requests.local)} local, ${fmtNum(h.requests.cloud)} cloud ` +
      `(cloud share ${fmtPct(h.cloud_share)} of ${fmtNum(total)}); since start ${fmtPct(st.cloud.share)}; ` +
      `cloud ${st.cloud.enabled ? "on" : "off"}, breaker ${st.cloud.breaker}`;
    const pts = st.traffic.points;
    lineChart($("chart-tokens"), [
      { name: "local", points: pts.map((p) => [p.t, p.local_tokens]) },
      { name: "cloud", points: pts.map((p) => [p.t, p.cloud_tokens]) },
    ], { xfmt: clock });
    const reasons = Object.entries(st.overflow || {}).map(([k, v]) => `${k} ${v}`).join(", ");
    $("overflow").textContent = reasons ? `sent to the cloud, by reason: ${reasons}` : "";
  }

  function renderCost(st) {
    const c = st.cost;
    const dl = $("cost");
    if (!c) {
      dl.replaceChildren(el("dt", {}, "prices"), el("dd", {}, "none: add a cost: section to the YAML"));
      return;
    }
    const cur = c.currency;
    const item = (k, v) => [el("dt", {}, k), el("dd", {}, v)];
    dl.replaceChildren(
      ...item("local, per 1M tokens", fmtMoney(c.local_per_1m, cur)),
      ...item("cloud, per 1M tokens", fmtMoney(c.cloud_per_1m, cur)),
      ...item("spill, last hour", fmtMoney(c.spill_last_hour, cur)),
      ...item("spill, last day", fmtMoney(c.spill_last_day, cur)),
      ...item("tokens, last hour", `${fmtNum(c.local_tokens_last_hour)} local, ${fmtNum(c.cloud_tokens_last_hour)} cloud`),
    );
  }

  function memory(res) {
    if (!res) return "-";
    let s = `RSS ${fmtBytes(res.rss_bytes)} (peak ${fmtBytes(res.peak_rss_bytes)})`;
    if (res.device === "cuda" && res.device_memory_bytes != null) {
      s += `; GPU ${fmtBytes(res.device_memory_bytes)} of ${fmtBytes(res.device_memory_total_bytes)}`;
      s += ` (peak ${fmtBytes(res.device_peak_memory_bytes)})`;
      if (res.gpu_utilization != null) s += `, util ${fmtPct(res.gpu_utilization, 0)}`;
    }
    return s;
  }

  function renderReplicas(st) {
    const now = st.time;
    fillBody($("replicas"), st.replicas.map((r) => {
      const bar = el("span", { class: "kvbar" }, el("span"));
      bar.firstChild.style.width = `${Math.round((r.kv_usage || 0) * 100)}%`;
      const health = r.usable ? "ready" : r.phase || "not ready";
      return el("tr", { "data-replica": `${r.revision}/${r.replica}` },
        el("td", {}, r.revision), el("td", {}, r.replica), el("td", { class: r.usable ? "good" : "warn" }, health),
        el("td", {}, bar, fmtPct(r.kv_usage, 0)), el("td", { class: "num" }, fmtNum(r.waiting)),
        el("td", { class: "num" }, fmtNum(r.running)), el("td", { class: "num" }, fmtNum(r.restarts)),
        el("td", {}, memory(r.resources)));
    }));
    const live = new Set();
    for (const r of st.replicas) {
      const id = `rev ${r.revision} ${r.replica}`;
      live.add(id);
      const h = replicaHistory.get(id) || [];
      h.push({ t: now, kv: r.kv_usage == null ? null : r.kv_usage * 100, queue: r.waiting == null ? null : r.waiting + r.running });
      replicaHistory.set(id, h.slice(-KEEP_POINTS));
    }
    for (const id of [...replicaHistory.keys()]) if (!live.has(id)) replicaHistory.delete(id);
    const series = (f) => [...replicaHistory.entries()].map(([name, h]) => ({ name, points: h.map((p) => [p.t, f(p)]) }));
    lineChart($("chart-kv"), series((p) => p.kv), { xfmt: clock, ymax: 100, yfmt: (v) => v.toFixed(0) });
    lineChart($("chart-queue"), series((p) => p.queue), { xfmt: clock });
  }

  function renderBench(st) {
    const b = st.bench;
    if (!b || !b.levels || !b.levels.length) {
      lineChart($("chart-bench-tput"), [], { empty: "no saved bench result" });
      lineChart($("chart-bench-ttft"), [], { empty: "no saved bench result" });
      return;
    }
    $("bench-note").textContent = `${b.file}: ${b.mode}, ${b.started_at || ""}. ${b.verdict || ""}`;
    const lv = b.levels;
    const opts = { xticks: lv.map((l) => l.value), xfmt: (v) => fmtNum(v) };
    lineChart($("chart-bench-tput"), [
      { name: "output tokens/s", points: lv.map((l) => [l.value, l.output_tokens_per_s]) },
    ], opts);
    const sla = b.sla && b.sla.ttft_p99_ms;
    const worst = Math.max(0, ...lv.map((l) => l.ttft_p99_ms || 0));
    // an SLA far above every level would flatten the curve: then it is named, not drawn
    const drawn = sla && sla <= 4 * worst;
    lineChart($("chart-bench-ttft"), [
      { name: "TTFT p50", points: lv.map((l) => [l.value, l.ttft_p50_ms]) },
      { name: drawn || !sla ? "TTFT p99" : `TTFT p99 (SLA ${sla} ms, off the chart)`, points: lv.map((l) => [l.value, l.ttft_p99_ms]) },
    ], { ...opts, hlines: drawn ? [{ y: sla, label: `SLA p99 ${sla} ms` }] : [] });
  }

  function renderEvents(st) {
    const events = [...(st.events || [])].reverse();
    const bad = new Set(["auto-rollback", "engine-crash", "engine-failed", "failed"]);
    fillBody($("events"), events.map((e) =>
      el("tr", { "data-kind": e.kind }, el("td", {}, clock(e.ts)), el("td", { class: bad.has(e.kind) ? "bad" : "" }, e.kind),
        el("td", {}, e.revision ?? ""), el("td", {}, e.message))));
    if (!st.daemon) fillBody($("events"), [el("tr", {}, el("td", { colspan: 4, class: "muted" }, "standalone router: no control-plane events"))]);
  }

  function render(st) {
    $("deployment").textContent = st.deployment || "";
    $("alias").textContent = `model ${st.alias}`;
    $("daemon").textContent = st.daemon ? "" : "standalone router";
    $("updated").textContent = `updated ${clock(st.time)}`;
    for (const f of [renderRevisions, renderCompare, renderTraffic, renderCost, renderReplicas, renderBench, renderEvents]) {
      try {
        f(st);
      } catch (err) {
        setStatus(`could not draw ${f.name}: ${err}`);
      }
    }
  }

  // ---- auth and polling -------------------------------------------------------------------------------------
  function setStatus(text) {
    $("status").textContent = text;
  }
  function showLogin(message) {
    clearTimeout(timer);
    $("board").hidden = true;
    $("logout").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = message || "";
    $("key").focus();
  }
  function showBoard() {
    $("login").hidden = true;
    $("board").hidden = false;
    $("logout").hidden = !authRequired;
  }
  function schedule() {
    clearTimeout(timer);
    timer = setTimeout(poll, POLL_MS);
  }
  async function poll() {
    const headers = { Accept: "application/json" };
    const key = sessionStorage.getItem(KEY);
    if (key) headers.Authorization = `Bearer ${key}`;
    let resp;
    try {
      resp = await fetch("/dashboard/api/state", { headers, cache: "no-store" });
    } catch (err) {
      setStatus(`router unreachable (${err.message}); retrying`);
      schedule();
      return;
    }
    if (resp.status === 401) {
      sessionStorage.removeItem(KEY);
      showLogin(key ? "That key was not accepted." : "");
      return;
    }
    if (!resp.ok) {
      setStatus(`state: HTTP ${resp.status}; retrying`);
      schedule();
      return;
    }
    const st = await resp.json();
    showBoard();
    setStatus("");
    render(st);
    schedule();
  }

  $("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const value = $("key").value.trim();
    if (!value) return;
    sessionStorage.setItem(KEY, value);
    $("key").value = "";
    poll();
  });
  $("logout").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    showLogin("");
  });
  if (authRequired && !sessionStorage.getItem(KEY)) showLogin("");
  else poll();
})();
