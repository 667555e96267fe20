"""`llmdeploy validate`, `plan` and `schema`: everything that needs only the YAML file."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer
import yaml
from rich.console import Group, RenderableType
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from llmdeploy.cli.console import EXIT_INVALID, console, examples, fail, plain
from llmdeploy.spec.loader import SpecFileError, SpecResult, load_spec_file
from llmdeploy.spec.models import DeploymentSpec, is_loopback

if TYPE_CHECKING:
    from llmdeploy.engine.estimate import Estimate

FILE_ARG = typer.Argument(..., help="The deployment YAML, e.g. llmdeploy.yaml.", show_default=False)


def load_or_exit(path: Path) -> DeploymentSpec:
    """Print warnings, and the errors one per line (FILE:LINE:COL: path: message); exit 2 if invalid, 1 if unreadable."""
    try:
        result: SpecResult = load_spec_file(path)
    except SpecFileError as e:
        fail(str(e))
    for issue in result.warnings:
        plain(issue.format("warning"), err=True)
    if result.spec is None or result.errors:
        for issue in result.errors:
            plain(issue.format())
        n = len(result.errors)
        plain(f"{path}: {n} error{'s' if n != 1 else ''}", err=True)
        raise typer.Exit(EXIT_INVALID)
    return result.spec


def validate(file: Path = FILE_ARG) -> None:
    """Check a deployment YAML and report every problem at once.

    Each error is one line: FILE:LINE:COL: dotted.path: message.

    Exit code 0: valid (a summary follows); 2: invalid; 1: the file cannot be read.
    """
    spec = load_or_exit(file)
    check_placement(file, spec, None)
    console.print(render_summary(spec))
    plain(f"{file}: valid")


def plan(
    file: Path = FILE_ARG,
    prompt_len: int = typer.Option(512, "--prompt-len", min=1, help="Average prompt tokens, for capacity."),
    output_len: int = typer.Option(256, "--output-len", min=1, help="Average output tokens, for capacity."),
) -> None:
    """Show what `apply` would run: the spec with defaults filled in, its memory and capacity estimate, the
    changes against the deployment's last applied spec, and, while it runs, its measured throughput ceiling.

    The estimate reads the model's config only (no weights): weights memory, KV bytes per token, and the KV
    cache's capacity in tokens and in concurrent sequences of max_model_len and of the average length given.
    The ceiling comes from each running engine's step-cost model (fixed + per prefill token + per decoding
    sequence, fitted from its own steps).
    """
    from llmdeploy.cli.plan_live import diff_lines, live_ceilings
    from llmdeploy.engine.estimate import EstimateError, estimate_spec

    spec = load_or_exit(file)
    try:
        est = estimate_spec(spec)
    except EstimateError as e:
        fail(f"cannot estimate memory for {spec.model.path}: {e}")
    console.print(render_plan(spec, est, diff_lines(spec), avg=(prompt_len, output_len)))
    placement = check_placement(file, spec, est.device, show=True)
    ceilings = live_ceilings(spec, est, prompt_len, output_len)
    if ceilings is not None:
        console.print(ceilings)
    if placement.errors:
        raise typer.Exit(EXIT_INVALID)


def check_placement(file: Path, spec: DeploymentSpec, device: str | None, show: bool = False):
    """Replicas x ranks against the backend's CPUs and GPUs: problems as FILE:LINE:COL lines on stderr.
    `validate` (show False) judges the local backend only, without a network call, and exits 2 on an error;
    `plan` also asks a Ray cluster and shows the placement."""
    from llmdeploy.cli.placement_view import issue_lines, render_placement, spec_placement

    if not show and spec.parallel.backend != "local":
        return None
    placement = spec_placement(spec, device)
    if show:
        console.print(_heading("Placement"))
        console.print(render_placement(placement))
    for line in issue_lines(file, placement):
        plain(line, err=True)
    if placement.errors and not show:
        raise typer.Exit(EXIT_INVALID)
    return placement


def schema() -> None:
    """Print the JSON Schema of the YAML, for editors (yaml-language-server) and other tools."""
    plain(json.dumps(spec_json_schema(), indent=2))


def spec_json_schema() -> dict:
    body = DeploymentSpec.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **body, "title": "llmdeploy.yaml"}


def normalised_yaml(spec: DeploymentSpec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False, default_flow_style=False, width=1000)


def render_summary(spec: DeploymentSpec) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    m = spec.model
    t.add_row("name", spec.name)
    t.add_row("model", f"{m.path}  (dtype {m.dtype}, max_model_len {m.max_model_len})")
    t.add_row("alias", m.served_alias)
    exposure = "loopback only" if is_loopback(spec.listen_host) else "reachable from other machines"
    t.add_row("listen", f"{'https' if spec.tls.enabled else 'http'}://{spec.listen}  ({exposure})")
    t.add_row("auth", _auth_line(spec))
    p = spec.parallel
    t.add_row("replicas", f"{p.replicas} x tensor_parallel {p.tensor_parallel} ({p.backend})")
    e = spec.engine
    t.add_row(
        "engine",
        f"device {e.device}, block_size {e.block_size}, max_num_seqs {e.max_num_seqs}, "
        f"max_num_batched_tokens {e.max_num_batched_tokens}, kv_cache_gb {e.kv_cache_gb}",
    )
    t.add_row("cloud", _cloud_line(spec))
    t.add_row("SLA", f"TTFT p99 {spec.sla.ttft_p99_ms:g} ms, TPOT p99 {spec.sla.tpot_p99_ms:g} ms")
    r = spec.rollout
    auto = "auto-rollback on" if r.auto_rollback.enabled else "auto-rollback off"
    t.add_row("rollout", f"canary {r.canary_percent:g}%, sticky by {r.sticky_header}, {auto}")
    return t


def _auth_line(spec: DeploymentSpec) -> str:
    a = spec.auth
    if not a.api_key_required:
        return "off: no key needed (loopback only)"
    if not a.keys:
        return "required; no keys configured (apply generates one)"
    # names and variable names only: a key's value never reaches the terminal
    parts = [f"{k.name} ({'$' + k.key_env if k.key_env else 'sha256 hash'})" for k in a.keys]
    return f"required; keys: {', '.join(parts)}"


def _cloud_line(spec: DeploymentSpec) -> str:
    c = spec.cloud
    if not c.enabled:
        return "off (everything is served locally)"
    key = "set" if os.environ.get(c.api_key_env or "") else "NOT set"
    return f"{c.provider} {c.base_url} model {c.model or '(alias)'}; key ${c.api_key_env} {key}"


def render_plan(
    spec: DeploymentSpec,
    estimate: Estimate | None = None,
    diff: Sequence[str] | None = None,
    avg: tuple[int, int] | None = None,
) -> Group:
    """What apply would do. `diff`: lines starting with +, - or a space, against the deployment's last applied
    spec (None: it was never applied). `avg`: average prompt and output tokens for the capacity line."""
    parts: list[RenderableType] = [
        _heading("Spec (defaults filled in)"),
        Syntax(normalised_yaml(spec), "yaml", theme="ansi_dark", background_color="default"),
    ]
    if estimate is not None:
        parts += [
            _heading("Estimate (from the model's config; no weights loaded)"),
            render_estimate(estimate, avg),
        ]
        parts += [Text(f"note: {n}", style="yellow") for n in estimate.notes]
    parts.append(_heading("Changes against the last applied spec"))
    if diff is None:
        parts.append(Text(f"none applied yet: `llmdeploy apply` would create deployment {spec.name!r}"))
    elif not diff:
        parts.append(Text("none: the running deployment already matches this spec"))
    else:
        styles = {"+": "green", "-": "red"}
        parts += [Text(line, style=styles.get(line[:1], "")) for line in diff]
    return Group(*parts)


def _heading(title: str) -> Text:
    return Text(f"\n{title}", style="bold")


def render_estimate(est: Estimate, avg: tuple[int, int] | None = None) -> Table:
    s = est.shape
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    params = f"{s.num_params / 1e6:.1f}M parameters" if s.num_params else "parameters unknown"
    t.add_row(
        "model",
        f"{s.model_type}: {s.num_layers} layers, {s.num_heads} heads ({s.num_kv_heads} KV), head_dim {s.head_dim}, {params}",
    )
    t.add_row("device / dtype", f"{est.device} / {est.dtype}")
    t.add_row("weights memory", _size(est.weights_bytes))
    t.add_row(
        "KV bytes / token",
        f"{est.kv_bytes_per_token:,} B  (2 x {s.num_layers} layers x {s.num_kv_heads} x {s.head_dim})",
    )
    t.add_row(
        "KV cache", f"{_size(est.kv_budget_bytes)} = {est.kv_blocks:,} blocks of {est.block_size} tokens"
    )
    t.add_row(
        "KV capacity",
        f"{est.kv_tokens:,} tokens = {est.max_model_len_seqs:,} sequences of max_model_len {est.max_model_len}",
    )
    if avg is not None:
        p, o = avg
        t.add_row("", f"= {est.kv_tokens // (p + o):,} concurrent sequences of {p} + {o} tokens (average)")
    if est.replicas > 1:
        t.add_row("all replicas", f"{est.replicas} x {_size(est.weights_bytes + est.kv_budget_bytes)}")
    return t


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def register(app: typer.Typer) -> None:
    app.command(
        epilog=examples(
            "llmdeploy validate llmdeploy.yaml",
            "llmdeploy validate llmdeploy.yaml.example && echo ok",
            "QIANFAN_API_KEY=... llmdeploy validate prod.yaml",
        )
    )(validate)
    app.command(
        epilog=examples("llmdeploy plan llmdeploy.yaml", "llmdeploy plan llmdeploy.yaml.example | less -R")
    )(plan)
    app.command(
        epilog=examples(
            "llmdeploy schema > llmdeploy.schema.json",
            "# then first line of llmdeploy.yaml: # yaml-language-server: $schema=./llmdeploy.schema.json",
        )
    )(schema)
