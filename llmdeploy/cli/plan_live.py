"""What `plan` adds from the deployment itself: the diff against its last applied spec (state.db) and, while it
runs, the throughput ceiling of each engine from the step-cost model it measured (policies/step_cost.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table

from llmdeploy.control.client import AdminClient, AdminError
from llmdeploy.control.paths import DeploymentPaths
from llmdeploy.control.state import StateStore
from llmdeploy.policies.step_cost import StepCost, throughput_ceiling
from llmdeploy.spec.models import DeploymentSpec

if TYPE_CHECKING:
    from llmdeploy.engine.estimate import Estimate


def last_applied_spec(paths: DeploymentPaths) -> dict[str, Any] | None:
    if not paths.state_db.is_file():
        return None
    store = StateStore(paths.state_db)
    try:
        dep = store.deployment()
        return dep.spec if dep else None
    finally:
        store.close()


def diff_lines(spec: DeploymentSpec) -> list[str] | None:
    """'+'/'-' lines against the deployment of this name, or None when it was never applied."""
    from llmdeploy.control.diff import diff_specs

    last = last_applied_spec(DeploymentPaths.of(spec.name))
    return None if last is None else diff_specs(last, spec).lines()


def live_ceilings(spec: DeploymentSpec, est: Estimate, prompt_len: int, output_len: int) -> Table | None:
    """Per running engine: its step model and the output tokens/s it can sustain at the concurrency its slots
    and KV cache allow for requests of the average length. None when the deployment is not running."""
    client = AdminClient(DeploymentPaths.of(spec.name))
    if client.alive() is None:
        return None
    try:
        st = client.status()
    except AdminError:
        return None
    t = Table(title="Measured throughput ceiling (running engines' step model)", title_justify="left")
    t.add_column("replica")
    # fixed (+ with prefill tokens) + per prefill token + per decoding sequence
    t.add_column("step cost", no_wrap=True)
    for col in ("batch", "tok/s", "req/s"):
        t.add_column(col, justify="right")
    for r in st.get("replicas", []):
        cost = StepCost.from_json(r.get("step_cost"))
        if cost is None:
            continue
        kv_tokens = r.get("kv_tokens") or (r.get("total_blocks") or 0) * est.block_size
        kv_seqs = kv_tokens // (prompt_len + output_len)
        batch = max(1, min(r.get("max_num_seqs") or spec.engine.max_num_seqs, kv_seqs or 1))
        c = throughput_ceiling(cost, batch, prompt_len, output_len)
        model = (
            f"{cost.fixed_s * 1e3:.1f} (+{cost.prefill_step_s * 1e3:.1f}) ms"
            f" + {cost.prefill_token_s * 1e3:.3f} ms/token"
            f" + {cost.decode_seq_s * 1e3:.2f} ms/seq"
        )
        t.add_row(
            f"rev {r['revision']} {r['replica']}",
            model,
            str(batch),
            f"{c.output_tokens_per_s:,.0f}",
            f"{c.requests_per_s:.2f}",
        )
    return t if t.row_count else None
