"""The traffic's transitions by hand and by the watcher (control/transitions.py), table by table, without a
process: every move's traffic, effects in order and answer, and every refusal with its message (the CLI prints
them; keep them byte-identical) and status."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmdeploy.control import transitions as tx
from llmdeploy.control.traffic import (
    PERSIST,
    PUBLISH,
    Emit,
    Engines,
    Move,
    Refusal,
    SetRevisionState,
    Snapshot,
    StartRevision,
    StopRevision,
    Traffic,
    UseSpec,
)
from tests.control.traffic_world import (
    ALONE,
    CANARY,
    DECISION,
    LOADING,
    NO_CANDIDATE,
    NOT_READY,
    PROMOTED,
    READY,
    STARTING,
    V1,
    V2,
    V3,
    aborted,
    promoted,
    row,
)

# ---- refusals: a value, nothing carried out ----------------------------------------------------------------

ROLLED_FORWARD = (
    "this file declares the model/engine/parallel settings of revision 2, which was rolled back ({reason}); "
    "applying it would roll forward again. Fix the file, or pass --force to start it as a new revision "
    "anyway."
)
REFUSALS = {
    "canary below 0": (lambda: tx.set_canary_share(CANARY, -1), "--percent must be between 0 and 100", 400),
    "canary above 100": (
        lambda: tx.set_canary_share(CANARY, 100.5),
        "--percent must be between 0 and 100",
        400,
    ),
    "canary range before candidate": (
        lambda: tx.set_canary_share(ALONE, 101),
        "--percent must be between 0 and 100",
        400,
    ),
    "canary, no candidate": (
        lambda: tx.set_canary_share(ALONE, 10),
        f"cannot set a canary share: {NO_CANDIDATE}",
        409,
    ),
    "promote, no candidate": (lambda: tx.promote(ALONE), f"cannot promote: {NO_CANDIDATE}", 409),
    "canary, candidate starting": (
        lambda: tx.set_canary_share(STARTING, 10),
        f"cannot set a canary share: {NOT_READY}",
        409,
    ),
    "promote, candidate starting": (lambda: tx.promote(STARTING), f"cannot promote: {NOT_READY}", 409),
    "promote, stored ready but an engine restarts": (
        lambda: tx.promote(replace(CANARY, engines={1: READY, 2: LOADING})),
        f"cannot promote: {NOT_READY}",
        409,
    ),
    "promote, engines ready but not yet settled": (
        lambda: tx.promote(replace(STARTING, engines={1: READY, 2: Engines("ready")})),
        "cannot promote: candidate revision 2 is not ready yet (); watch it with `llmdeploy status`",
        409,
    ),
    "rollback, nothing served before": (
        lambda: tx.roll_back(ALONE),
        "nothing to roll back to: no canary is running and no earlier revision has served",
        409,
    ),
    "rollback, to an unknown revision": (
        lambda: tx.roll_back(PROMOTED, 99),
        "there is no revision 99; see `llmdeploy history`",
        400,
    ),
    "rollback, to one that never served": (
        lambda: tx.roll_back(
            replace(PROMOTED, revisions=(*PROMOTED.revisions, row(3, "rolled-back", V3))), 3
        ),
        "revision 3 never served (rolled-back); pick one from `llmdeploy history`",
        409,
    ),
    "rollback, to the stable one": (
        lambda: tx.roll_back(PROMOTED, 2),
        "revision 2 is already the stable revision",
        409,
    ),
    "rollback, to an unknown revision during a canary": (
        lambda: tx.roll_back(CANARY, 99),
        "there is no revision 99; see `llmdeploy history`",
        400,
    ),
    "rollback, to the candidate itself": (
        lambda: tx.roll_back(CANARY, 2),
        "revision 2 never served (rolled-back); pick one from `llmdeploy history`",
        409,
    ),
    "apply of a rolled-back revision's settings": (
        lambda: tx.refuse_roll_forward(
            replace(
                ALONE, revisions=(*ALONE.revisions, replace(row(2, "rolled-back", V2), reason="automatic: x"))
            ),
            V2,
        ),
        ROLLED_FORWARD.format(reason="automatic: x"),
        409,
    ),
    "apply of a revision rolled back by hand": (
        lambda: tx.refuse_roll_forward(
            replace(ALONE, revisions=(*ALONE.revisions, row(2, "rolled-back", V2))), V2
        ),
        ROLLED_FORWARD.format(reason="by hand"),
        409,
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusal(case):
    decide, message, status = REFUSALS[case]
    assert decide() == Refusal(message, status)


def test_applying_the_stable_revisions_settings_or_new_ones_is_no_roll_forward():
    rolled_back = replace(CANARY, revisions=(*CANARY.revisions, row(3, "rolled-back", V1)))
    assert tx.refuse_roll_forward(rolled_back, V1) is None  # the stable revision runs these settings
    assert tx.refuse_roll_forward(rolled_back, V3) is None  # never rolled back


# ---- moves by hand -----------------------------------------------------------------------------------------


PROMOTE_ANSWER = {"result": "promoted", "stable": 2, "retired": 1}
ABORT_ANSWER = {"result": "rolled back", "rolled_back": 2, "stable": 1, "reason": "rollback by hand"}
MOVES = {
    "canary 10": (
        lambda: tx.set_canary_share(CANARY, 10),
        Traffic(1, 2, 10.0),
        (
            SetRevisionState(2, "serving"),
            PERSIST,
            PUBLISH,
            Emit("canary", "candidate 2: 0% -> 10% (stable 1: 90%)", 2),
        ),
        {"result": "canary", "candidate": 2, "percent": 10, "stable": 1},
    ),
    "canary back to 0": (
        lambda: tx.set_canary_share(replace(CANARY, traffic=Traffic(1, 2, 25.0)), 0),
        Traffic(1, 2, 0.0),
        (
            SetRevisionState(2, "ready"),
            PERSIST,
            PUBLISH,
            Emit("canary", "candidate 2: 25% -> 0% (stable 1: 100%)", 2),
        ),
        {"result": "canary", "candidate": 2, "percent": 0, "stable": 1},
    ),
    "canary 100 promotes": (
        lambda: tx.set_canary_share(CANARY, 100),
        Traffic(2),
        promoted(2, 1, "canary --percent 100"),
        PROMOTE_ANSWER,
    ),
    "promote": (lambda: tx.promote(CANARY), Traffic(2), promoted(2, 1, "promote"), PROMOTE_ANSWER),
    "rollback during a canary": (
        lambda: tx.roll_back(CANARY),
        Traffic(1),
        aborted(2, "rollback by hand"),
        ABORT_ANSWER,
    ),
    "rollback to the stable one during a canary": (
        lambda: tx.roll_back(CANARY, 1),
        Traffic(1),
        aborted(2, "rollback by hand"),
        ABORT_ANSWER,
    ),
    "rollback without a canary: undo": (
        lambda: tx.roll_back(PROMOTED),
        Traffic(2, 3, 0.0),
        (
            UseSpec(V1),
            StartRevision(3, V1, "rollback to 1"),
            PERSIST,
            PUBLISH,
            Emit(
                "rollback",
                "re-deploying revision 1 as revision 3; it takes 100% once ready",
                3,
                {"to_revision": 1, "from_revision": 2},
            ),
        ),
        {"result": "rolling back", "revision": 3, "to_revision": 1, "stable": 2},
    ),
    "automatic rollback of the judged candidate": (
        lambda: tx.auto_roll_back(CANARY, DECISION, 2),
        Traffic(1),
        aborted(2, f"automatic: {DECISION.reason}", "auto-rollback", DECISION.numbers()),
        {**ABORT_ANSWER, "reason": f"automatic: {DECISION.reason}"},
    ),
    "automatic rollback, the judged one is gone": (
        lambda: tx.auto_roll_back(CANARY, DECISION, 7),
        Traffic(1, 2),
        (),
        {"result": "nothing to roll back"},
    ),
    "automatic rollback, no candidate": (
        lambda: tx.auto_roll_back(PROMOTED, DECISION, 2),
        Traffic(2),
        (),
        {"result": "nothing to roll back"},
    ),
}


@pytest.mark.parametrize("case", list(MOVES))
def test_move(case):
    decide, traffic, effects, answer = MOVES[case]
    move = decide()
    assert isinstance(move, Move) and move.earlier == ()
    assert (move.traffic, move.effects, move.answer) == (traffic, effects, answer)


def test_promoting_an_undo_rolls_the_old_stable_back():
    undoing = replace(
        PROMOTED,
        traffic=Traffic(2, 3),
        revisions=(*PROMOTED.revisions, row(3, "ready", V1, origin="rollback to 1")),
        engines={2: READY, 3: READY},
    )
    move = tx.promote(undoing)
    assert move == Move(
        Traffic(3),
        promoted(3, 2, "promote", "rolled-back", "undone"),
        {**PROMOTE_ANSWER, "stable": 3, "retired": 2},
    )


def test_rollback_to_an_earlier_revision_during_a_canary_aborts_then_redeploys():
    three = Snapshot(
        Traffic(2, 3, 10.0),
        V3,
        (row(1, "retired", served=True), row(2, "serving", V2, served=True), row(3, "serving", V3)),
        {2: READY, 3: READY},
    )
    move = tx.roll_back(three, 1)
    assert isinstance(move, Move)
    abort, undo = move.steps()  # carried out in this order, each with its own traffic
    assert abort.traffic == Traffic(2) and abort.effects[-1] == StopRevision(3, wait=True)
    assert abort.effects[1:3] == (SetRevisionState(3, "rolled-back", "rollback by hand"), UseSpec(V2))
    assert undo.traffic == Traffic(2, 4, 0.0) and StartRevision(4, V1, "rollback to 1") in undo.effects
    assert move.answer == {"result": "rolling back", "revision": 4, "to_revision": 1, "stable": 2}
    after = three.after(move)
    states = [(r.id, r.state) for r in after.revisions]
    assert states == [(1, "retired"), (2, "serving"), (3, "rolled-back"), (4, "starting")]
    assert after.traffic == Traffic(2, 4, 0.0) and after.spec == V1 and after.next_revision_id == 5


def test_the_value_names_phase_roles_and_split():
    phases = [Traffic().phase, Traffic(1).phase, Traffic(1, 2, 10.0).phase]
    assert phases == ["empty", "stable only", "canary"]
    assert Traffic(1, 2, 10.0).roles() == [(1, "stable"), (2, "candidate")]
    assert Traffic(1, 2, 10.0).split() == {1: 90.0, 2: 10.0} and Traffic(1, None, 0.0).split() == {1: 100.0}
