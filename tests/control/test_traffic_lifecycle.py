"""The traffic's transitions on apply, on the supervisor's news and on a new daemon (control/transitions.py),
table by table, without a process: each move's traffic and effects in order."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmdeploy.control import transitions as tx
from llmdeploy.control.traffic import (
    PERSIST,
    PUBLISH,
    Emit,
    Engines,
    MarkServed,
    Move,
    SetRevisionState,
    Snapshot,
    StartRevision,
    StopRevision,
    Traffic,
)
from tests.control.traffic_world import (
    ALONE,
    CANARY,
    FAILED,
    PROMOTED,
    READY,
    STARTING,
    V1,
    V2,
    V3,
    promoted,
    row,
    spec,
)

# ---- apply -------------------------------------------------------------------------------------------------


def test_the_first_revision_is_stable_and_a_later_one_is_the_candidate_at_zero():
    empty = Snapshot(Traffic(), None)
    assert tx.start_revision(empty, V1, "apply") == Move(
        Traffic(1), (StartRevision(1, V1, "apply"),), {"revision": 1}
    )
    assert tx.start_revision(ALONE, V2, "apply") == Move(
        Traffic(1, 2), (StartRevision(2, V2, "apply"),), {"revision": 2}
    )


def test_a_newer_candidate_supersedes_the_one_in_flight():
    move = tx.start_revision(replace(CANARY, traffic=Traffic(1, 2, 30.0)), V3, "apply")
    assert move == Move(
        Traffic(1, 3, 0.0),
        (
            StartRevision(3, V3, "apply"),
            SetRevisionState(2, "retired", "superseded by revision 3"),
            StopRevision(2, wait=False),
            Emit("retire", "candidate 2 superseded by revision 3", 2),
        ),
        {"revision": 3},
    )


# snapshot (its spec: the file just applied), the spec before -> apply's `canary` answer, the traffic after
REAPPLIES = {
    "first apply": (replace(CANARY, spec=spec(8, 30)), None, None, None),
    "same percent": (replace(CANARY, spec=spec(8, 30)), spec(8, 30), None, None),
    "no candidate": (replace(ALONE, spec=spec(16, 30)), spec(16, 0), None, None),
    "candidate starting": (
        replace(STARTING, spec=spec(8, 30)),
        spec(8, 0),
        {"candidate": 2, "percent": 30, "when": "ready"},
        Traffic(1, 2),
    ),
    "candidate ready": (
        replace(CANARY, spec=spec(8, 30)),
        spec(8, 0),
        {"candidate": 2, "percent": 30, "when": "now"},
        Traffic(1, 2, 30.0),
    ),
    "100 promotes, and says which": (
        replace(CANARY, spec=spec(8, 100)),
        spec(8, 0),
        {"candidate": 2, "percent": 100, "when": "now"},
        Traffic(2),
    ),
}


@pytest.mark.parametrize("case", list(REAPPLIES))
def test_reapplied_canary_percent(case):
    now, before, answer, traffic = REAPPLIES[case]
    move = tx.reapply_canary_percent(now, before)
    assert (move and move.answer, move and move.traffic) == (answer, traffic)


def test_a_reapplied_share_moves_like_canary_does():
    move = tx.reapply_canary_percent(replace(CANARY, spec=spec(8, 30)), spec(8, 0))
    by_hand = tx.set_canary_share(CANARY, 30)
    assert move is not None and isinstance(by_hand, Move) and move.effects == by_hand.effects
    promoting = tx.reapply_canary_percent(replace(CANARY, spec=spec(8, 100)), spec(8, 0))
    assert promoting is not None and promoting.effects == promoted(2, 1, "rollout.canary_percent is 100")


# ---- the supervisor's news ---------------------------------------------------------------------------------


def starting(canary_percent: float = 0, origin: str = "apply") -> Snapshot:
    return replace(
        STARTING,
        spec=spec(8, canary_percent),
        revisions=(STARTING.revisions[0], row(2, "starting", V2, origin=origin)),
        engines={1: READY, 2: READY},
    )


SETTLES = {
    "the first revision is ready": (
        Snapshot(Traffic(1), V1, (row(1, "starting"),), {1: READY}),
        1,
        Traffic(1),
        (
            SetRevisionState(1, "serving"),
            MarkServed(1),
            Emit("ready", "revision 1 is ready and serving 100%", 1),
        ),
    ),
    "a candidate is ready at 0%": (
        starting(),
        2,
        Traffic(1, 2, 0.0),
        (
            SetRevisionState(2, "ready"),
            PERSIST,
            Emit("ready", "candidate revision 2 is ready; it takes 0% of traffic", 2),
        ),
    ),
    "a candidate is ready at rollout.canary_percent": (
        starting(30),
        2,
        Traffic(1, 2, 30.0),
        (
            SetRevisionState(2, "serving"),
            PERSIST,
            Emit("ready", "candidate revision 2 is ready; it takes 30% of traffic", 2),
        ),
    ),
    "canary_percent 100 promotes at once": (
        starting(100),
        2,
        Traffic(2),
        promoted(2, 1, "rollout.canary_percent is 100"),
    ),
    "an undo is promoted at once": (
        starting(0, origin="rollback to 1"),
        2,
        Traffic(2),
        promoted(2, 1, "rollback", "rolled-back", "undone"),
    ),
    "a candidate fails": (
        replace(STARTING, engines={1: READY, 2: FAILED}),
        2,
        Traffic(1),
        (
            SetRevisionState(2, "failed", "failed: exit code 1"),
            PERSIST,
            PUBLISH,
            Emit("failed", "revision 2 failed to start: failed: exit code 1", 2),
            StopRevision(2, wait=True, failed=True),
        ),
    ),
    "the stable fails: the candidate becomes stable": (
        replace(CANARY, traffic=Traffic(1, 2, 30.0), engines={1: Engines("failed"), 2: READY}),
        1,
        Traffic(2),
        (
            SetRevisionState(1, "failed", "engines failed"),
            PERSIST,
            PUBLISH,
            Emit("failed", "revision 1 failed to start: engines failed", 1),
            StopRevision(1, wait=True, failed=True),
        ),
    ),
}


@pytest.mark.parametrize("case", list(SETTLES))
def test_settle(case):
    now, rev, traffic, effects = SETTLES[case]
    move = tx.settle(now, rev)
    assert move is not None and (move.traffic, move.effects) == (traffic, effects)


FAILED_ONCE = (STARTING.revisions[0], row(2, "failed", V2))


@pytest.mark.parametrize(
    "now, rev",
    [
        (STARTING, 2),  # still loading
        (CANARY, 2),  # ready, and already settled
        (replace(STARTING, engines={1: READY, 2: FAILED}, revisions=FAILED_ONCE), 2),  # already failed
        (PROMOTED, 1),  # not in the traffic any more
    ],
)
def test_nothing_to_settle(now, rev):
    assert tx.settle(now, rev) is None


@pytest.mark.parametrize(
    "stored, live, resumed",
    [
        (Traffic(1, 2, 10.0), {1, 2}, Traffic(1, 2, 10.0)),  # the same split
        (Traffic(1, 2, 10.0), {1}, Traffic(1)),  # the candidate stopped while no daemon ran
        (Traffic(1, 2, 10.0), {2}, Traffic(2)),  # the candidate left alone becomes stable
        (Traffic(1), set(), Traffic()),
    ],
)
def test_a_new_daemon_resumes_the_traffic_of_what_still_runs(stored, live, resumed):
    revisions = [row(rid, "serving" if rid in live else "failed") for rid in (1, 2)]
    assert tx.resumed(stored, revisions) == resumed
