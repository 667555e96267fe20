"""`llmdeploy bench`: load-test any OpenAI-compatible URL and judge it against the SLA.

Option parsing and the report's outputs live here; the load generator, the statistics and the judgements are
in llmdeploy/loadgen/.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import asdict
from pathlib import Path

import typer
from rich.text import Text

from llmdeploy.cli import bench_extras
from llmdeploy.cli.console import (
    EXIT_ERROR,
    EXIT_INVALID,
    EXIT_OK,
    console,
    err_console,
    examples,
    fail,
    warn,
)
from llmdeploy.control.bench_results import save_report
from llmdeploy.control.paths import DeploymentNotFound

HELP = "\n\n".join(
    (
        "Load-test an OpenAI-compatible endpoint (llmdeploy's router, one engine, or anything else) and judge it against the SLA.",
        'Each load level runs for --duration or --requests: closed loop with --concurrency (N requests in flight at all times) or open loop with --rate (Poisson arrivals per second, as real traffic comes; latencies count from each arrival). Per level: requests/s, output tokens/s, TTFT p50/p90/p99, TPOT p50/p99, end-to-end p50/p99, success rate with error kinds, the share served locally or by the cloud (x-llmdeploy-backend; "unknown" when the server does not send it) and the server\'s KV usage and queue sampled from /metrics (absent when it has none).',
        'Prompts: --prompt-len N words of common English (about N tokens for BPE vocabularies; the JSON report has the server\'s mean usage.prompt_tokens per level), or --mix LONG:SHORT with --mix-ratio L:S (request counts, default 1:1; --mix 1500:128 --mix-ratio 1:4 sends one 1500-token prompt for every four 128-token ones), or --dataset FILE.jsonl (one {"prompt": ...} or {"messages": [...]} per line, optional "max_tokens").',
        "Verdict: the highest level whose success rate is at least --min-success and whose TTFT p99 and TPOT p99 are within the targets (--sla-from llmdeploy.yaml's sla section, or --ttft-p99-ms / --tpot-p99-ms).",
        "--burst 3x:20s then drills a burst: the sustainable rate (the highest --rate level that met the SLA, else the requests/s of the highest --concurrency level that did) for half the burst's length, 3x that rate for 20 s, then the sustainable rate for 2x the burst's length (or 3x:20s:60s for 60 s), and reports what became of the requests (local on time, local late, cloud, rejected with 429/503) and when TTFT p99 was back under the target.",
        "--compare BASELINE.json runs the baseline's load again (unless flags say otherwise) and prints each figure's change; a figure that moved the wrong way by more than --tolerance is a regression.",
        "Exit code 0: the highest load asked meets the SLA (and no regression); 1: it misses, a regression, or the server cannot be reached; 2: invalid input (flags, unreadable files).",
    )
)


# one typer.Option per flag: the blocks look alike on purpose (name, type and help differ; typer wants each)
def bench(
    url: str | None = typer.Option(
        None, "--url", help="Base URL, e.g. http://127.0.0.1:8000 (/v1 is added unless the URL ends in /vN)."
    ),
    model: str | None = typer.Option(
        None, "--model", help="Model name to send (llmdeploy: the served alias)."
    ),
    api_key_env: str | None = typer.Option(
        None,
        "--api-key-env",
        help="Environment variable holding the API key (sent as a Bearer token; never printed).",
    ),
    concurrency: str | None = typer.Option(
        None, "--concurrency", "-c", help="Closed-loop levels, e.g. 1,4,16,32 (default)."
    ),
    rate: str | None = typer.Option(
        None, "--rate", "-r", help="Open-loop levels in requests/s, e.g. 2,5,10."
    ),
    duration: str | None = typer.Option(
        None, "--duration", "-d", help="Length of each level, e.g. 30s (default), 2m."
    ),
    requests: int | None = typer.Option(
        None, "--requests", "-n", help="Requests per level, instead of --duration."
    ),
    prompt_len: int | None = typer.Option(
        None, "--prompt-len", help="Synthetic prompt length in tokens, about (default 128)."
    ),
    output_len: int | None = typer.Option(
        None, "--output-len", help="max_tokens of each request (default 128)."
    ),
    mix: str | None = typer.Option(None, "--mix", help="LONG:SHORT prompt lengths in tokens, e.g. 1500:128."),
    mix_ratio: str | None = typer.Option(
        None, "--mix-ratio", help="LONG:SHORT request counts for --mix, e.g. 1:4 (default 1:1)."
    ),
    dataset: Path | None = typer.Option(
        None, "--dataset", help="JSONL file of requests: prompt or messages, optional max_tokens."
    ),
    stream: bool | None = typer.Option(
        None, "--stream/--no-stream", help="Stream answers (default; TTFT and TPOT need it)."
    ),
    json_out: Path | None = typer.Option(
        None, "--json", help="Write every figure to this JSON file (--compare reads it)."
    ),
    chart: Path | None = typer.Option(
        None, "--chart", help="Draw load vs throughput and latency with the SLA lines: OUT.png or OUT.html."
    ),
    sla_from: Path | None = typer.Option(
        None,
        "--sla-from",
        help="llmdeploy.yaml: its sla targets; also its URL, alias and API key variable unless given.",
    ),
    ttft_p99_ms: float | None = typer.Option(
        None, "--ttft-p99-ms", help="TTFT p99 target in ms (overrides --sla-from)."
    ),
    tpot_p99_ms: float | None = typer.Option(
        None, "--tpot-p99-ms", help="TPOT p99 target in ms (overrides --sla-from)."
    ),
    min_success: str = typer.Option("99%", "--min-success", help="Lowest success rate that meets the SLA."),
    burst: str | None = typer.Option(
        None, "--burst", help="Burst drill FACTORx:DURATION[:WATCH], e.g. 3x:20s."
    ),
    compare: Path | None = typer.Option(
        None, "--compare", help="Baseline JSON from an earlier --json: rerun its load, print changes."
    ),
    tolerance: str = typer.Option(
        "10%", "--tolerance", help="How far a figure may move the wrong way under --compare."
    ),
    metrics_url: list[str] = typer.Option(
        [],
        "--metrics-url",
        help="Prometheus URL(s) to sample instead of URL/metrics, e.g. an engine's http://127.0.0.1:PORT/metrics (repeatable).",
    ),
    timeout: str | None = typer.Option(
        None,
        "--timeout",
        help="Per-request limit, e.g. 120s (default); a request over it counts as a timeout.",
    ),
    warmup: int | None = typer.Option(
        None, "--warmup", help="Requests sent before the first level, not counted (default 2)."
    ),
    seed: int | None = typer.Option(
        None, "--seed", help="Seed of prompts and arrival times: same seed, same load (default 0)."
    ),
    ignore_eos: bool | None = typer.Option(
        None,
        "--ignore-eos/--no-ignore-eos",
        help="Ask for exactly --output-len tokens (a vLLM/llmdeploy extension; default off).",
    ),
    ca_file: Path | None = typer.Option(
        None, "--ca-file", help="CA bundle (PEM) for an https URL with a private or self-signed certificate."
    ),
    max_inflight: int | None = typer.Option(
        None, "--max-inflight", help="Open loop: most requests in flight from this client (default 1024)."
    ),
    save: bool = typer.Option(
        False,
        "--save",
        help="Also keep the JSON report in the deployment's state folder ($LLMDEPLOY_HOME/NAME/bench/); `status` and /dashboard show the newest curve.",
    ),
    name: str | None = typer.Option(
        None, "--name", help="Deployment for --save (default: --sla-from's name, else the only one)."
    ),
) -> None:
    from llmdeploy.loadgen.compare import compare_levels
    from llmdeploy.loadgen.config import BenchOptions, ConfigError, resolve
    from llmdeploy.loadgen.report import burst_view, compare_table, levels_tables, report_dict
    from llmdeploy.loadgen.session import BenchError, run_session

    opts = BenchOptions(**{k: v for k, v in locals().items() if k in BenchOptions.__dataclass_fields__})
    try:
        resolved = resolve(opts, os.environ)
    except ConfigError as e:
        fail(str(e), EXIT_INVALID)
    cfg = resolved.config
    spec = bench_extras.spec_of(sla_from)
    try:  # before the run: a --save that cannot be kept is known at once
        save_to = bench_extras.save_target(spec, name) if save else None
    except DeploymentNotFound as e:
        fail(f"--save: {e}", EXIT_INVALID)
    for note in resolved.notes:
        warn(note)
    stop = f"{cfg.stop.requests} requests" if cfg.stop.requests else f"{cfg.stop.duration_s:g} s"
    err_console.print(
        f"bench {cfg.target.model} at {cfg.target.api_base}: {cfg.mode} "
        f"{', '.join(f'{v:g}' for v in cfg.levels)}, {stop} each"
    )
    started = dt.datetime.now(dt.timezone.utc)
    try:
        run = run_session(cfg, err_console)
    except BenchError as e:
        fail(str(e), EXIT_ERROR)
    except KeyboardInterrupt:
        fail("interrupted", EXIT_ERROR)
    for note in run.notes:
        warn(note)

    comparison = None
    if resolved.baseline is not None:
        current = [asdict(lv) for lv in run.levels]
        comparison = compare_levels(resolved.baseline["levels"], current, resolved.tolerance)
    code = (
        EXIT_OK if run.verdict.asked_meets_sla and not (comparison and comparison.regressions) else EXIT_ERROR
    )

    console.print(levels_tables(run.levels, f"{cfg.target.model} at {cfg.url}"))
    console.print(
        Text.assemble(("verdict: ", "green" if run.verdict.asked_meets_sla else "red"), run.verdict.summary)
    )
    if run.burst:
        console.print(burst_view(run.burst))
    if comparison:
        console.print(compare_table(comparison, str(opts.compare)))
        for name in comparison.only_in_baseline:
            warn(f"{name} is in the baseline but was not run now")
        n = len(comparison.regressions)
        console.print(f"{n} regression{'s' if n != 1 else ''} beyond {resolved.tolerance:.0%}")
    report = report_dict(cfg, run, comparison, code, started, resolved.api_key_env)
    priced = bench_extras.level_cost(spec, run.levels, run.verdict)  # with --sla-from's cost: section
    if priced:
        console.print(f"cost at {priced[0].value:g} {cfg.mode}: {priced[1].line()}")
        report["cost"] = bench_extras.cost_json(*priced)
    try:
        if json_out:
            json_out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
            err_console.print(f"wrote {json_out}")
        if chart:
            from llmdeploy.loadgen.chart import write_chart

            write_chart(report, chart)
            err_console.print(f"wrote {chart}")
        if save_to:
            err_console.print(f"saved {save_report(save_to, report)}")
    except OSError as e:
        fail(f"cannot write {e.filename or 'the output'}: {e.strerror or e}", EXIT_ERROR)
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command(
        help=HELP,
        epilog=examples(
            "llmdeploy bench --sla-from llmdeploy.yaml --concurrency 1,4,16,32 --duration 30s --chart bench.png",
            "llmdeploy bench --url http://127.0.0.1:8000 --model chat --api-key-env LLMDEPLOY_API_KEY --rate 2,5,10 --requests 200 --json base.json",
            "llmdeploy bench --sla-from llmdeploy.yaml --rate 2,4,8 --burst 3x:20s",
            "llmdeploy bench --sla-from llmdeploy.yaml --mix 1500:128 --mix-ratio 1:4 --concurrency 8",
            "llmdeploy bench --compare base.json --tolerance 10%   # same load again; exit 1 on a regression",
        ),
    )(bench)
