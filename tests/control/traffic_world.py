"""The world the traffic tests decide in: specs, stored revisions, the supervisor's phases, a few snapshots of
a deployment, and the effects of the two moves most transitions end in (promote, abort)."""

from __future__ import annotations

from dataclasses import replace

from llmdeploy.control import revisions as rv
from llmdeploy.control.state import Revision
from llmdeploy.control.traffic import (
    PERSIST,
    PUBLISH,
    Emit,
    Engines,
    EventKind,
    MarkServed,
    ReplicaPhase,
    SetRevisionState,
    Snapshot,
    StopRevision,
    Traffic,
    UseSpec,
)
from llmdeploy.policies.rollback import RollbackDecision
from llmdeploy.spec.models import DeploymentSpec


def spec(max_num_seqs: int = 16, canary_percent: float = 0) -> DeploymentSpec:
    return DeploymentSpec.model_validate(
        {"engine": {"max_num_seqs": max_num_seqs}, "rollout": {"canary_percent": canary_percent}}
    )


V1, V2, V3 = spec(16), spec(8), spec(4)  # three engine settings: three revision hashes


def row(
    rid: int, state: str, of: DeploymentSpec = V1, origin: str = "apply", served: bool = False
) -> Revision:
    data = rv.spec_dict(of)
    return Revision(rid, data, rv.revision_hash(data), 0.0, state, "", origin, served)


READY = Engines("ready", (ReplicaPhase("r1", "ready"),))
LOADING = Engines("starting", (ReplicaPhase("r1", "loading weights"), ReplicaPhase("r2", "warming up")))
FAILED = Engines("failed", (ReplicaPhase("r1", "ready"), ReplicaPhase("r2", "failed: exit code 1", True)))

# stable 1 serving alone; with candidate 2 ready at 0%, or still starting; 2 stable after a promotion
ALONE = Snapshot(Traffic(1), V1, (row(1, "serving", served=True),), {1: READY})
CANARY = Snapshot(
    Traffic(1, 2), V2, (row(1, "serving", served=True), row(2, "ready", V2)), {1: READY, 2: READY}
)
STARTING = replace(
    CANARY, revisions=(CANARY.revisions[0], row(2, "starting", V2)), engines={1: READY, 2: LOADING}
)
PROMOTED = Snapshot(
    Traffic(2),
    V2,
    (row(1, "retired", served=True), row(2, "serving", V2, served=True)),
    {2: READY},
)
DECISION = RollbackDecision(
    True, "error rate 50.0% > max_error_rate 5.0%", 40, 20, 0.5, 80.0, 60.0, 0.05, 3000, 20
)
# the CLI prints refusals as they are: these are the exact texts
NO_CANDIDATE = (
    "there is no candidate revision (stable is 1). "
    "Apply a spec that changes model, engine or parallel to start one."
)
NOT_READY = (
    "candidate revision 2 is not ready yet (r1: loading weights, r2: warming up); "
    "watch it with `llmdeploy status`"
)


def promoted(
    rev: int, old: int, reason: str, old_state: rv.RevisionState = "retired", why: str = "replaced"
) -> tuple:
    return (
        SetRevisionState(rev, "serving"),
        MarkServed(rev),
        SetRevisionState(old, old_state, f"{why} by revision {rev}"),
        PERSIST,
        PUBLISH,  # the old revision leaves the table before its engines get SIGTERM
        StopRevision(old, wait=False),
        Emit(
            "promote", f"revision {rev} takes 100% ({reason}); revision {old} stops", rev, {"previous": old}
        ),
    )


def aborted(rev: int, reason: str, kind: EventKind = "rollback", data: dict | None = None) -> tuple:
    return (
        PUBLISH,  # stable takes 100% before the candidate's engines stop
        SetRevisionState(rev, "rolled-back", reason),
        UseSpec(V1),  # the stable revision's settings again
        PERSIST,
        Emit(kind, f"candidate {rev} rolled back, stable 1 takes 100%: {reason}", rev, data or {}),
        StopRevision(rev, wait=True),
    )
