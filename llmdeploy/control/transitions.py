"""Every move of the traffic between revisions, as a pure function of a Snapshot (ARCHITECTURE.md §5, §6).

Each returns a `Move` (the traffic after it, the effects to carry out in order, the admin API's answer) or a
`Refusal` (nothing happens); the controller carries moves out under its lock. Nothing here touches a process,
a file or the clock, so every rule and every refusal is tested without engines
(tests/control/test_traffic.py).

  set_canary_share        `canary --percent P`: the ready candidate takes P% (100 promotes)
  promote                 the ready candidate becomes stable at 100%; the old stable retires (or is undone)
  roll_back               by hand: abort the candidate, or undo (re-deploy an earlier revision as a new one)
  auto_roll_back          the watcher's judgement aborts the candidate it judged
  start_revision          apply or undo: a new revision starts, as the stable one or as the candidate
  reapply_canary_percent  a hot reload changed rollout.canary_percent: a ready candidate's share moves
  settle                  the supervisor's news: a revision's engines became ready, or failed
  resumed                 a new daemon's traffic: revisions that no longer run leave it
  scale                   the autoscaler's decision adds or removes one replica of the stable revision
  refuse_roll_forward     applying a rolled-back revision's settings again needs --force
"""

from __future__ import annotations

from dataclasses import replace

from llmdeploy.control import revisions as rv
from llmdeploy.control.state import Revision
from llmdeploy.control.traffic import (
    PERSIST,
    PUBLISH,
    AddReplica,
    Effect,
    Emit,
    EventKind,
    MarkServed,
    Move,
    Refusal,
    RemoveReplica,
    SetRevisionState,
    Snapshot,
    StartRevision,
    StopRevision,
    Traffic,
    UseSpec,
)
from llmdeploy.policies.autoscale import Action, Decision
from llmdeploy.policies.rollback import RollbackDecision
from llmdeploy.spec.models import DeploymentSpec

# ---- by hand (the admin API) -------------------------------------------------------------------------------


def set_canary_share(now: Snapshot, percent: float) -> Move | Refusal:
    if not 0 <= percent <= 100:
        return Refusal("--percent must be between 0 and 100", 400)
    if refusal := _unless_candidate_ready(now, "set a canary share"):
        return refusal
    return _share(now, percent, promote_reason="canary --percent 100")


def promote(now: Snapshot) -> Move | Refusal:
    if refusal := _unless_candidate_ready(now, "promote"):
        return refusal
    return _promote(now, reason="promote")


def roll_back(now: Snapshot, to_revision: int | None = None) -> Move | Refusal:
    """During a canary: abort it, and with --to-revision N (not the stable one) then re-deploy N. Without one:
    undo. A refused undo leaves the canary running: the abort is only carried out with the undo after it."""
    if now.traffic.phase != "canary":
        return _undo(now, to_revision)
    abort = _abort(now, decision=None)
    if to_revision in (None, now.traffic.stable):
        return abort
    undo = _undo(now.after(abort), to_revision)
    return undo if isinstance(undo, Refusal) else abort.then(undo)


def _unless_candidate_ready(now: Snapshot, verb: str) -> Refusal | None:
    rev = now.traffic.candidate
    if rev is None:
        return Refusal(
            f"cannot {verb}: there is no candidate revision (stable is {now.traffic.stable}). "
            "Apply a spec that changes model, engine or parallel to start one."
        )
    if not _candidate_ready(now):
        phases = ", ".join(f"{r.name}: {r.phase}" for r in now.engines_of(rev).replicas)
        return Refusal(
            f"cannot {verb}: candidate revision {rev} is not ready yet ({phases}); "
            "watch it with `llmdeploy status`"
        )
    return None


def _candidate_ready(now: Snapshot) -> bool:
    rev = now.traffic.candidate
    return rev is not None and now.state_of(rev) != rv.STARTING and now.engines_of(rev).phase == "ready"


def _share(now: Snapshot, percent: float, promote_reason: str) -> Move:
    """The ready candidate takes `percent` of traffic; 100 promotes it."""
    if percent >= 100:
        return _promote(now, promote_reason)
    t = now.traffic
    rev = t.candidate
    assert rev is not None
    message = f"candidate {rev}: {t.percent:g}% -> {percent:g}% (stable {t.stable}: {100 - percent:g}%)"
    effects = (
        SetRevisionState(rev, rv.SERVING if percent > 0 else rv.READY),
        PERSIST,
        PUBLISH,
        Emit("canary", message, rev),
    )
    answer = {"result": "canary", "candidate": rev, "percent": percent, "stable": t.stable}
    return Move(replace(t, percent=float(percent)), effects, answer)


def _promote(now: Snapshot, reason: str) -> Move:
    """The candidate becomes stable at 100%; the old stable retires, or is rolled back when the candidate was
    started to undo it."""
    rev, old = now.traffic.candidate, now.traffic.stable
    assert rev is not None
    effects: list[Effect] = [SetRevisionState(rev, rv.SERVING), MarkServed(rev)]
    if old is not None:
        if _is_undo(now.revision(rev)):
            effects.append(SetRevisionState(old, rv.ROLLED_BACK, f"undone by revision {rev}"))
        else:
            effects.append(SetRevisionState(old, rv.RETIRED, f"replaced by revision {rev}"))
    effects += [PERSIST, PUBLISH]  # the old revision leaves the table before its engines get SIGTERM
    if old is not None:
        effects.append(StopRevision(old, wait=False))
    message = f"revision {rev} takes 100% ({reason}); revision {old} stops"
    effects.append(Emit("promote", message, rev, {"previous": old}))
    return Move(Traffic(stable=rev), tuple(effects), {"result": "promoted", "stable": rev, "retired": old})


def _is_undo(row: Revision | None) -> bool:
    return row is not None and row.origin.startswith("rollback")


def _abort(now: Snapshot, decision: RollbackDecision | None) -> Move:
    """The candidate is rolled back: the stable revision takes 100% before the candidate's engines stop, and
    the applied spec takes the stable revision's settings again."""
    rev, stable, spec = now.traffic.candidate, now.traffic.stable, now.spec
    assert rev is not None and spec is not None
    reason = f"automatic: {decision.reason}" if decision else "rollback by hand"
    effects: list[Effect] = [PUBLISH, SetRevisionState(rev, rv.ROLLED_BACK, reason)]
    if stable_row := now.revision(stable):
        effects.append(UseSpec(rv.with_revision_of(spec, stable_row.spec)))
    message = f"candidate {rev} rolled back, stable {stable} takes 100%: {reason}"
    kind: EventKind = "auto-rollback" if decision else "rollback"
    effects += [PERSIST, Emit(kind, message, rev, decision.numbers() if decision else {})]
    effects.append(StopRevision(rev, wait=True))
    answer = {"result": "rolled back", "rolled_back": rev, "stable": stable, "reason": reason}
    return Move(Traffic(stable=stable), tuple(effects), answer)


def _undo(now: Snapshot, to_revision: int | None) -> Move | Refusal:
    """No canary: re-deploy an earlier revision's settings as a new revision (kubectl rollout undo); it is
    promoted as soon as it is ready."""
    try:
        target = rv.undo_target(list(now.revisions), now.traffic.stable, to_revision)
    except rv.NoRollbackTarget as e:
        return Refusal(str(e), 400 if e.bad_input else 409)
    assert now.spec is not None  # a revision exists, so a spec was applied
    spec = rv.with_revision_of(now.spec, target.spec)
    started = start_revision(now, spec, origin=f"rollback to {target.id}")
    rev, stable = started.answer["revision"], started.traffic.stable
    message = f"re-deploying revision {target.id} as revision {rev}; it takes 100% once ready"
    effects = (
        UseSpec(spec),
        *started.effects,
        PERSIST,
        PUBLISH,
        Emit("rollback", message, rev, {"to_revision": target.id, "from_revision": stable}),
    )
    answer = {"result": "rolling back", "revision": rev, "to_revision": target.id, "stable": stable}
    return Move(started.traffic, effects, answer)


# ---- the watcher -------------------------------------------------------------------------------------------


def auto_roll_back(now: Snapshot, decision: RollbackDecision, judged: int) -> Move:
    """The watcher judged revision `judged` without the lock: abort it only if it is still the candidate."""
    if now.traffic.candidate is None or now.traffic.candidate != judged:
        return Move(now.traffic, answer={"result": "nothing to roll back"})
    return _abort(now, decision)


# ---- apply -------------------------------------------------------------------------------------------------


def refuse_roll_forward(now: Snapshot, spec: DeploymentSpec) -> Refusal | None:
    """A new revision with the settings of one that was rolled back would roll forward again: refused unless
    `--force` (the caller skips this) or the stable revision already runs those settings."""
    wanted = rv.revision_hash(spec)
    stable = now.revision(now.traffic.stable) if now.traffic.stable else None
    if stable and stable.spec_hash == wanted:
        return None
    for r in reversed(now.revisions):
        if r.spec_hash == wanted and r.state == rv.ROLLED_BACK:
            return Refusal(
                f"this file declares the model/engine/parallel settings of revision {r.id}, which was "
                f"rolled back ({r.reason or 'by hand'}); applying it would roll forward again. Fix the file, "
                "or pass --force to start it as a new revision anyway."
            )
    return None


def start_revision(now: Snapshot, spec: DeploymentSpec, origin: str) -> Move:
    """A new revision starts: the stable one when there is none (it serves once ready), else the candidate at
    0%, superseding a candidate still in flight. The answer names the new revision; persisting and publishing
    are left to the caller, which has more to change (apply) or less (undo)."""
    t, rev = now.traffic, now.next_revision_id
    effects: list[Effect] = [StartRevision(rev, spec, origin)]
    if t.stable is None:
        return Move(Traffic(stable=rev), tuple(effects), {"revision": rev})
    if (old := t.candidate) is not None:
        effects += [
            SetRevisionState(old, rv.RETIRED, f"superseded by revision {rev}"),
            StopRevision(old, wait=False),
            Emit("retire", f"candidate {old} superseded by revision {rev}", old),
        ]
    return Move(Traffic(t.stable, rev, 0.0), tuple(effects), {"revision": rev})


def reapply_canary_percent(now: Snapshot, before: DeploymentSpec | None) -> Move | None:
    """`now.spec` (just applied, no new revision) changed rollout.canary_percent: a ready candidate takes the
    new share at once (100 promotes), a starting one takes it when ready. None: nothing to move. The answer is
    what apply reports as `canary`."""
    assert now.spec is not None
    percent, rev = now.spec.rollout.canary_percent, now.traffic.candidate
    if before is None or before.rollout.canary_percent == percent or rev is None:
        return None
    if not _candidate_ready(now):
        return Move(now.traffic, answer={"candidate": rev, "percent": percent, "when": "ready"})
    moved = _share(now, percent, promote_reason="rollout.canary_percent is 100")
    return replace(moved, answer={"candidate": rev, "percent": percent, "when": "now"})


# ---- the supervisor's news, a new daemon -------------------------------------------------------------------


def settle(now: Snapshot, rev: int) -> Move | None:
    """What the supervisor's news means for revision `rev` of the traffic. None: nothing to do."""
    if rev not in (now.traffic.stable, now.traffic.candidate):
        return None
    phase, state = now.engines_of(rev).phase, now.state_of(rev)
    if phase == "failed" and state in rv.LIVE_STATES:
        return _failed(now, rev)
    if phase == "ready" and state == rv.STARTING:
        return _ready(now, rev)
    return None


def _ready(now: Snapshot, rev: int) -> Move:
    t, spec = now.traffic, now.spec
    assert spec is not None
    if rev == t.stable:
        message = f"revision {rev} is ready and serving 100%"
        return Move(t, (SetRevisionState(rev, rv.SERVING), MarkServed(rev), Emit("ready", message, rev)))
    if _is_undo(now.revision(rev)):
        return _promote(now, reason="rollback")
    percent = spec.rollout.canary_percent
    if percent >= 100:
        return _promote(now, reason="rollout.canary_percent is 100")
    message = f"candidate revision {rev} is ready; it takes {percent:g}% of traffic"
    effects = (
        SetRevisionState(rev, rv.SERVING if percent > 0 else rv.READY),
        PERSIST,
        Emit("ready", message, rev),
    )
    return Move(replace(t, percent=percent), effects)


def _failed(now: Snapshot, rev: int) -> Move:
    """A revision whose engines gave up leaves the traffic; when it was the stable one, the candidate (if any)
    becomes stable."""
    t = now.traffic
    reason = next((r.phase for r in now.engines_of(rev).replicas if r.failed), "engines failed")
    after = Traffic(stable=t.stable) if rev == t.candidate else Traffic(stable=t.candidate)
    effects = (
        SetRevisionState(rev, rv.FAILED, reason),
        PERSIST,
        PUBLISH,
        Emit("failed", f"revision {rev} failed to start: {reason}", rev),
        StopRevision(rev, wait=True, failed=True),
    )
    return Move(after, effects)


def resumed(traffic: Traffic, revisions: list[Revision] | tuple[Revision, ...]) -> Traffic:
    """A new daemon's traffic: the stored one without revisions that no longer run; a candidate left alone
    becomes stable."""
    live = {r.id for r in revisions if r.state in rv.LIVE_STATES}
    stable = traffic.stable if traffic.stable in live else None
    candidate = traffic.candidate if traffic.candidate in live else None
    if stable is None:
        return Traffic(stable=candidate)
    return Traffic(stable, candidate, traffic.percent if candidate is not None else 0.0)


# ---- the autoscaler ----------------------------------------------------------------------------------------


def scale(now: Snapshot, rev: int, decision: Decision, judged_replicas: int) -> Move:
    """The autoscaler judged revision `rev` at `judged_replicas` replicas without the lock: carry its decision
    out only if `rev` is still the stable revision with that many replicas (else the next tick judges again).
    The traffic does not change: the routing table follows the engines' readiness."""
    replicas = now.engines_of(rev).replicas
    if rev != now.traffic.stable or len(replicas) != judged_replicas or decision.action == Action.HOLD:
        return Move(now.traffic, answer={"result": "nothing to scale"})
    after = judged_replicas + (1 if decision.action == Action.UP else -1)
    if decision.action == Action.UP:
        change: Effect = AddReplica(rev)
        what = f"revision {rev}: {judged_replicas} -> {after} replicas (one starts)"
    else:
        assert decision.replica is not None
        if decision.replica not in {r.name for r in replicas}:
            return Move(now.traffic, answer={"result": "nothing to scale"})
        change = RemoveReplica(rev, decision.replica)
        what = f"revision {rev}: {judged_replicas} -> {after} replicas ({decision.replica} drains)"
    data = {"action": str(decision.action), "from": judged_replicas, "to": after, "reason": decision.reason}
    if decision.replica:
        data["replica"] = decision.replica
    emit = Emit("scale", f"{what}: {decision.reason}", rev, data)
    return Move(now.traffic, (change, emit), {"result": str(decision.action), "replicas": after})
