"""Revisions: what makes one (model, engine, parallel), their states, and the traffic split between them.

A revision is an immutable set of engine processes. Its lifecycle (ARCHITECTURE.md §5; control/traffic.py
decides every step):
  starting -> ready (engines answer; a candidate waits here at 0%) -> serving (takes traffic)
           -> retired (replaced by a promotion or a newer candidate) | rolled-back (aborted or undone)
  starting -> failed (engines never became ready)
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from llmdeploy.control.state import Revision
from llmdeploy.spec.models import DeploymentSpec

RevisionState = Literal["starting", "ready", "serving", "retired", "failed", "rolled-back"]
STARTING: RevisionState = "starting"
READY: RevisionState = "ready"
SERVING: RevisionState = "serving"
RETIRED: RevisionState = "retired"
FAILED: RevisionState = "failed"
ROLLED_BACK: RevisionState = "rolled-back"
LIVE_STATES: tuple[RevisionState, ...] = (STARTING, READY, SERVING)  # states whose engines run
REVISION_SECTIONS = ("model", "engine", "parallel")


def spec_dict(spec: DeploymentSpec) -> dict[str, Any]:
    """The normalised spec as stored: every default filled in, so equal meaning gives equal JSON."""
    return spec.model_dump(mode="json")


def spec_hash(data: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def revision_hash(spec: DeploymentSpec | dict[str, Any]) -> str:
    data = spec_dict(spec) if isinstance(spec, DeploymentSpec) else spec
    return spec_hash({k: data[k] for k in REVISION_SECTIONS})


def with_revision_of(spec: DeploymentSpec, revision_spec: dict[str, Any]) -> DeploymentSpec:
    """`spec` with the model/engine/parallel sections of a revision: what a rollback makes effective."""
    data = spec_dict(spec)
    data.update({k: revision_spec[k] for k in REVISION_SECTIONS})
    return DeploymentSpec.model_validate(data)


def split(stable: int | None, candidate: int | None, candidate_percent: float) -> dict[int, float]:
    """Revision id -> percent of traffic. The stable revision takes what the candidate does not."""
    out: dict[int, float] = {}
    if stable is not None:
        out[stable] = 100.0 if candidate is None else 100.0 - candidate_percent
    if candidate is not None:
        out[candidate] = candidate_percent if stable is not None else 100.0
    return out


class NoRollbackTarget(ValueError):
    def __init__(self, message: str, bad_input: bool = False):
        super().__init__(message)
        self.bad_input = bad_input


def undo_target(revisions: list[Revision], stable: int | None, to_revision: int | None = None) -> Revision:
    """What `rollback` re-deploys when no canary runs: --to-revision N, or the latest earlier revision that
    served with other engine settings than the stable one (kubectl rollout undo)."""
    by_id = {r.id: r for r in revisions}
    if to_revision is not None:
        target = by_id.get(to_revision)
        if target is None:
            raise NoRollbackTarget(
                f"there is no revision {to_revision}; see `llmdeploy history`", bad_input=True
            )
        if to_revision == stable:
            raise NoRollbackTarget(f"revision {to_revision} is already the stable revision")
        if not target.served:
            raise NoRollbackTarget(
                f"revision {to_revision} never served ({target.state}); pick one from `llmdeploy history`"
            )
        return target
    current = by_id[stable].spec_hash if stable in by_id else None
    earlier = [r for r in revisions if r.served and r.id != stable and r.spec_hash != current]
    if not earlier:
        raise NoRollbackTarget(
            "nothing to roll back to: no canary is running and no earlier revision has served"
        )
    return earlier[-1]
