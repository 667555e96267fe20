"""What `llmdeploy bench` adds for the deployment it measured: the cost line (the spec's `cost:` prices applied to
a level's throughput) and `--save` (the report kept in the deployment's state folder for status and /dashboard)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmdeploy.control.paths import DeploymentPaths, resolve_name
from llmdeploy.policies.cost import BenchCost, Prices, bench_cost


def spec_of(sla_from: Path | None) -> Any:
    """--sla-from's spec when it is valid (resolve() already reported its problems), else None."""
    if sla_from is None:
        return None
    from llmdeploy.spec.loader import SpecFileError, load_spec_file

    try:
        result = load_spec_file(sla_from, env=os.environ)
    except SpecFileError:
        return None
    return result.spec if not result.errors else None


def level_cost(spec: Any, levels: list, verdict: Any) -> tuple[Any, BenchCost] | None:
    """(level, its cost) at the highest load that met the SLA, else at the highest load run."""
    prices = Prices.from_spec(getattr(spec, "cost", None))
    if not prices.configured or not levels:
        return None
    best = verdict.highest_passing
    chosen = next((lv for lv in levels if best is not None and lv.value == best.value), None)
    chosen = chosen or max(levels, key=lambda lv: lv.value)
    cost = bench_cost(
        prices, chosen.output_tokens_per_s, chosen.mean_prompt_tokens, chosen.mean_output_tokens
    )
    return (chosen, cost) if cost is not None else None


def cost_json(level: Any, cost: BenchCost) -> dict[str, Any]:
    return {"level": {"mode": level.mode, "value": level.value}, **cost.to_json()}


def save_target(spec: Any, name: str | None) -> DeploymentPaths:
    """Where --save keeps the report: --name, else --sla-from's deployment, else the only one.
    Raises DeploymentNotFound (its message says which --name to pass)."""
    return DeploymentPaths.of(resolve_name(name or (spec.name if spec is not None else None)))
