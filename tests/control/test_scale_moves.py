"""transitions.scale, the autoscaler's move, as a pure function (like tests/control/test_traffic.py); the
autoscaler's spill window; the replicas a new daemon takes back."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmdeploy.control import transitions as tx
from llmdeploy.control.autoscaler import SpillWindow
from llmdeploy.control.state import EngineRecord
from llmdeploy.control.supervisor import _replica_names
from llmdeploy.control.traffic import AddReplica, Emit, Engines, RemoveReplica, ReplicaPhase
from llmdeploy.policies.autoscale import Action, Decision, Streaks
from llmdeploy.spec.models import DeploymentSpec
from tests.control.traffic_world import ALONE, CANARY

UP = Decision(Action.UP, "SLA at risk for 31s: every replica queues 32+ requests", Streaks())
DOWN = Decision(Action.DOWN, "idle for 300s: 1 replica can carry the load", Streaks(), replica="r2")
HOLD = Decision(Action.HOLD, "steady", Streaks())
TWO = replace(
    ALONE, engines={1: Engines("ready", (ReplicaPhase("r1", "ready"), ReplicaPhase("r2", "ready")))}
)


def test_up_adds_one_replica_of_the_stable_revision_and_says_why():
    move = tx.scale(ALONE, 1, UP, judged_replicas=1)
    assert move.traffic == ALONE.traffic
    message = f"revision 1: 1 -> 2 replicas (one starts): {UP.reason}"
    data = {"action": "up", "from": 1, "to": 2, "reason": UP.reason}
    assert move.effects == (AddReplica(1), Emit("scale", message, 1, data))
    assert move.answer == {"result": "up", "replicas": 2}


def test_down_drains_the_chosen_replica():
    move = tx.scale(TWO, 1, DOWN, judged_replicas=2)
    message = f"revision 1: 2 -> 1 replicas (r2 drains): {DOWN.reason}"
    data = {"action": "down", "from": 2, "to": 1, "reason": DOWN.reason, "replica": "r2"}
    assert move.effects == (RemoveReplica(1, "r2"), Emit("scale", message, 1, data))
    assert move.traffic == TWO.traffic


@pytest.mark.parametrize(
    "now, rev, decision, judged",
    [
        (CANARY, 2, UP, 1),  # the candidate is never scaled
        (ALONE, 1, UP, 2),  # the count moved since the autoscaler looked
        (TWO, 1, DOWN, 1),
        (ALONE, 1, HOLD, 1),
        (TWO, 1, replace(DOWN, replica="r7"), 2),  # no such replica (any more)
        (replace(ALONE, traffic=replace(ALONE.traffic, stable=3)), 1, UP, 1),  # promoted meanwhile
    ],
)
def test_a_stale_or_empty_decision_changes_nothing(now, rev, decision, judged):
    move = tx.scale(now, rev, decision, judged)
    assert (
        move.effects == () and move.traffic == now.traffic and move.answer == {"result": "nothing to scale"}
    )


def test_spill_window_counts_over_the_last_window_only():
    w = SpillWindow()
    assert w.over(0.0, 10, answered=0, spilled=0) == (0, 0)
    assert w.over(5.0, 10, answered=50, spilled=20) == (20, 50)
    assert w.over(12.0, 10, answered=60, spilled=20) == (
        20,
        60,
    )  # the sample at 0 is still the window's start
    assert w.over(16.0, 10, answered=70, spilled=20) == (0, 20)  # from the sample at 5 on
    assert w.over(30.0, 10, answered=70, spilled=20) == (0, 0)
    assert w.over(31.0, 10, answered=3, spilled=1) == (0, 0)  # a new router: counting starts again


def test_a_new_daemon_takes_back_the_replicas_the_autoscaler_had_added_up_to_max():
    def records(*names: str) -> dict[str, EngineRecord]:
        return {n: EngineRecord(1, n, 100 + i, 9000 + i, 0.0, 0) for i, n in enumerate(names)}

    ranged = DeploymentSpec.model_validate({"parallel": {"replicas": {"min": 1, "max": 3}}})
    assert _replica_names(ranged, records()) == ["r1"]
    assert _replica_names(ranged, records("r1", "r3")) == ["r1", "r3"]
    assert _replica_names(ranged, records("r2", "r10", "r3", "r4")) == ["r1", "r2", "r3"]
    fixed = DeploymentSpec.model_validate({"parallel": {"replicas": 2}})
    assert _replica_names(fixed, records("r1", "r2", "r3")) == [
        "r1",
        "r2",
    ]  # a fixed count, exactly as before
