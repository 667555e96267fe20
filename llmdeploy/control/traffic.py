"""The traffic between revisions as a value, and the words its transitions speak (ARCHITECTURE.md §6).

`Traffic` is (stable, candidate, percent). A transition (transitions.py) reads a `Snapshot` (the traffic, the
applied spec, the stored revisions, the supervisor's view of their engines) and returns a `Refusal` (message
and HTTP-ish status: nothing happens) or a `Move`: the traffic after it, the effects to carry out in order,
the admin API's answer. The controller is the one writer: it carries out moves under its lock, effect by
effect. Everything here is a frozen value; nothing touches a process, a file or the clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from llmdeploy.control import revisions as rv
from llmdeploy.control.state import Revision
from llmdeploy.policies.snapshot import Role
from llmdeploy.spec.models import DeploymentSpec

TrafficPhase = Literal["empty", "stable only", "canary"]
EnginePhase = Literal["starting", "ready", "failed"]  # Supervisor.revision_phase
EventKind = Literal["canary", "promote", "rollback", "auto-rollback", "ready", "failed", "retire", "scale"]


@dataclass(frozen=True)
class Traffic:
    stable: int | None = None
    candidate: int | None = None
    percent: float = 0.0  # the candidate's share; the stable revision takes the rest

    @property
    def phase(self) -> TrafficPhase:
        if self.candidate is not None:
            return "canary"
        return "empty" if self.stable is None else "stable only"

    def roles(self) -> list[tuple[int, Role]]:
        """The revisions in the routing table, the stable one first."""
        pairs: tuple[tuple[int | None, Role], ...] = ((self.stable, "stable"), (self.candidate, "candidate"))
        return [(rev, role) for rev, role in pairs if rev is not None]

    def split(self) -> dict[int, float]:
        return rv.split(self.stable, self.candidate, self.percent)


@dataclass(frozen=True)
class ReplicaPhase:
    name: str
    phase: str  # what the user reads: "loading weights", "failed: exit code 1"...
    failed: bool = False


@dataclass(frozen=True)
class Engines:
    """What the supervisor says about one revision's engines."""

    phase: EnginePhase = "starting"
    replicas: tuple[ReplicaPhase, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    """What the controller knows when it decides a move."""

    traffic: Traffic
    spec: DeploymentSpec | None  # the applied spec (None before the first apply)
    revisions: tuple[Revision, ...] = ()  # every revision in state.db, oldest first
    engines: Mapping[int, Engines] = field(default_factory=dict)  # the revisions the supervisor runs

    def revision(self, rev: int | None) -> Revision | None:
        return next((r for r in self.revisions if r.id == rev), None)

    def state_of(self, rev: int) -> str:
        row = self.revision(rev)
        return row.state if row else "unknown"

    def engines_of(self, rev: int) -> Engines:
        return self.engines.get(rev, Engines())

    @property
    def next_revision_id(self) -> int:
        """The id state.db gives the next revision: revisions are never deleted and the controller alone
        creates them, under its lock (it checks the id it gets)."""
        return max((r.id for r in self.revisions), default=0) + 1

    def after(self, move: Move) -> Snapshot:
        """This snapshot as `move` leaves it: what a transition chained after it reads. The engines stay as
        they are (the supervisor reports their changes later)."""
        rows, spec = {r.id: r for r in self.revisions}, self.spec
        for step in move.steps():
            for effect in step.effects:
                if isinstance(effect, SetRevisionState) and effect.revision in rows:
                    row = rows[effect.revision]
                    reason = row.reason if effect.reason is None else effect.reason
                    rows[effect.revision] = replace(row, state=effect.state, reason=reason)
                elif isinstance(effect, MarkServed) and effect.revision in rows:
                    rows[effect.revision] = replace(rows[effect.revision], served=True)
                elif isinstance(effect, UseSpec):
                    spec = effect.spec
                elif isinstance(effect, StartRevision):
                    rows[effect.revision] = _new_row(effect)
        revisions = tuple(rows[rid] for rid in sorted(rows))
        return replace(self, traffic=move.traffic, spec=spec, revisions=revisions)


def _new_row(start: StartRevision) -> Revision:
    """The row state.db will hold for a revision that starts (the store stamps `created`; nothing reads it)."""
    data = rv.spec_dict(start.spec)
    return Revision(start.revision, data, rv.revision_hash(data), 0.0, rv.STARTING, "", start.origin, False)


# ---- effects: what the controller carries out, in the order a move lists them ------------------------------


@dataclass(frozen=True)
class StartRevision:
    """A row in state.db (`revision` is the id the store gives it) and the supervisor starts its engines."""

    revision: int
    spec: DeploymentSpec
    origin: str  # "apply" | "rollback to N": a revision undoing another is promoted as soon as it is ready


@dataclass(frozen=True)
class StopRevision:
    revision: int
    # True: the answer waits for the engines to exit (the CLI then says "stopped"); False: in the background
    wait: bool
    failed: bool = False  # a failed revision has nothing in flight worth the full drain


@dataclass(frozen=True)
class AddReplica:
    """The supervisor starts one more engine of the revision (autoscaling); it serves once ready."""

    revision: int


@dataclass(frozen=True)
class RemoveReplica:
    """The replica leaves the routing table, then drains and stops in the background (autoscaling)."""

    revision: int
    replica: str


@dataclass(frozen=True)
class SetRevisionState:
    revision: int
    state: rv.RevisionState
    reason: str | None = None  # None keeps the stored reason


@dataclass(frozen=True)
class MarkServed:
    revision: int  # it was the stable revision: a target for a later undo


@dataclass(frozen=True)
class UseSpec:
    spec: DeploymentSpec  # the applied spec becomes this (a rollback: the serving revision's settings again)


@dataclass(frozen=True)
class Persist:
    """Write the applied spec and the traffic to state.db: a new daemon resumes from there."""


@dataclass(frozen=True)
class Publish:
    """Swap the router's table to the traffic (and the engines ready now)."""


@dataclass(frozen=True)
class Emit:
    """An event in the audit log; the router counts it too (/metrics)."""

    kind: EventKind
    message: str
    revision: int | None = None
    data: dict[str, Any] | None = None


Effect = (
    StartRevision
    | StopRevision
    | AddReplica
    | RemoveReplica
    | SetRevisionState
    | MarkServed
    | UseSpec
    | Persist
    | Publish
    | Emit
)
PERSIST, PUBLISH = Persist(), Publish()


@dataclass(frozen=True)
class Move:
    traffic: Traffic  # after the move
    effects: tuple[Effect, ...] = ()
    answer: dict[str, Any] = field(default_factory=dict)  # the admin API's answer
    earlier: tuple[Move, ...] = ()  # moves carried out before this one, each with its own traffic

    def then(self, later: Move) -> Move:
        return replace(later, earlier=(*self.steps(), *later.earlier))

    def steps(self) -> tuple[Move, ...]:
        """The moves to carry out in order: the traffic is set to each one's before its effects run."""
        return (*self.earlier, replace(self, earlier=()))


@dataclass(frozen=True)
class Refusal:
    message: str  # shown to the user as is
    status: int = 409  # 400: the arguments are wrong; 409: the deployment's state forbids it
