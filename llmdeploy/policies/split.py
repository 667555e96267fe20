"""Sticky canary split and revision pinning.

A session's bucket is a hash of its sticky value (the `rollout.sticky_header` value, or the key name when the
header is absent) in [0, 100). It goes to the candidate when bucket < percent: for a fixed percentage a
session never switches, and raising the percentage only moves sessions from stable to candidate.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from llmdeploy.policies.snapshot import RevisionState

ChoiceError = Literal["revision_not_found", "revision_not_ready", "no_revision"]


def sticky_bucket(value: str) -> float:
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % 10_000 / 100.0


@dataclass(frozen=True)
class RevisionChoice:
    revision: RevisionState | None
    error: ChoiceError | None = None
    message: str = ""


def parse_pinned(header: str | None) -> int | None:
    """The `x-llmdeploy-revision` header as an int; ValueError with a message for junk."""
    if header is None or header.strip() == "":
        return None
    try:
        value = int(header.strip())
    except ValueError:
        raise ValueError(f"x-llmdeploy-revision must be a revision number, got {header[:32]!r}") from None
    if value < 0:
        raise ValueError("x-llmdeploy-revision must be a non-negative revision number")
    return value


def choose_revision(
    revisions: list[RevisionState], sticky_value: str, pinned: int | None = None
) -> RevisionChoice:
    if pinned is not None:
        match = next((r for r in revisions if r.revision == pinned), None)
        if match is None:
            known = ", ".join(str(r.revision) for r in revisions) or "none"
            return RevisionChoice(
                None, "revision_not_found", f"Revision {pinned} is not deployed (deployed: {known})."
            )
        if not match.ready:
            return RevisionChoice(
                None, "revision_not_ready", f"Revision {pinned} is deployed but not ready yet."
            )
        return RevisionChoice(match)
    if not revisions:
        return RevisionChoice(None, "no_revision", "No revision is deployed.")
    stable = next((r for r in revisions if r.role == "stable"), revisions[0])
    candidate = next((r for r in revisions if r.role == "candidate" and r is not stable), None)
    if candidate is not None and candidate.ready and sticky_bucket(sticky_value) < candidate.percent:
        return RevisionChoice(candidate)
    return RevisionChoice(stable)
