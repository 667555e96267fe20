"""Placement in `plan` and `validate`: which backend, replicas x ranks, what each replica reserves, and what does
not fit, as FILE:LINE:COL lines at the `parallel` key they concern (control/placement.py decides)."""

from __future__ import annotations

from pathlib import Path

import yaml
from rich.table import Table

from llmdeploy.control.placement import (
    NodeResources,
    Placement,
    PlacementIssue,
    local_resources,
    plan_placement,
)
from llmdeploy.spec.loader import SpecIssue, dotted
from llmdeploy.spec.models import DeploymentSpec


def spec_placement(spec: DeploymentSpec, device: str | None) -> Placement:
    """`device`: the engine's resolved device (cpu | cuda) on this machine, None when not resolved (then a local
    spec with device auto is not judged). A Ray cluster is asked when it answers; else the placement is shown
    without its check."""
    p = spec.parallel
    if p.backend == "local":
        gpu = (device or spec.engine.device) == "cuda"
        known = device is not None or spec.engine.device != "auto"
        nodes = [local_resources(gpu)] if known else None
        return plan_placement(spec, nodes, gpu, "this machine")
    from llmdeploy.control.ray_launcher import LaunchError, cluster_nodes

    where = f"the Ray cluster at {p.ray_address or 'auto'}"
    try:
        nodes: list[NodeResources] | None = cluster_nodes(p.ray_address)
    except LaunchError as e:
        nodes, note = None, f"not checked: {e}"
    else:
        note = ""
    gpu = spec.engine.device == "cuda" or (spec.engine.device == "auto" and any(n.gpus for n in nodes or []))
    return plan_placement(spec, nodes, gpu, where, note)


def render_placement(pl: Placement) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    t.add_row("backend", f"{pl.backend} ({pl.where})")
    t.add_row("replicas", f"{pl.replicas} x {pl.ranks} rank{'s' if pl.ranks != 1 else ''} (tensor_parallel)")
    gpus = f", {pl.gpus_per_replica:g} GPU" if pl.gpus_per_replica else ""
    keep = "on one node, reserved as a Ray placement group" if pl.backend == "ray" else "on this machine"
    t.add_row("per replica", f"{pl.cpus_per_replica:g} CPU{gpus} ({keep})")
    if pl.nodes is not None:
        total_cpu = sum(n.cpus for n in pl.nodes)
        total_gpu = sum(n.gpus for n in pl.nodes)
        count = f"{len(pl.nodes)} node{'s' if len(pl.nodes) != 1 else ''}: " if pl.backend == "ray" else ""
        t.add_row("resources", f"{count}{total_cpu:g} CPU, {total_gpu:g} GPU")
    if pl.fits is not None and pl.backend == "ray":
        t.add_row("room for", f"{pl.fits} replica{'s' if pl.fits != 1 else ''} at once")
    if pl.note:
        t.add_row("check", pl.note)
    return t


def issue_lines(file: Path, pl: Placement) -> list[str]:
    """Each placement problem as FILE:LINE:COL: severity: parallel.KEY: message."""
    try:
        root = yaml.compose(file.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError):
        root = None
    return [_issue(file, root, i).format(i.severity) for i in pl.issues]


def _issue(file: Path, root: yaml.Node | None, issue: PlacementIssue) -> SpecIssue:
    """At the key itself, or at the nearest key above it that the file spells out (a default has no line)."""
    mark, node = None, root
    for key in issue.loc:
        if not isinstance(node, yaml.MappingNode):
            break
        hit = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None)
        if hit is None:
            break
        mark = next(k for k, v in node.value if v is hit).start_mark
        node = hit
    line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
    return SpecIssue(str(file), line, col, dotted(issue.loc), issue.message)
