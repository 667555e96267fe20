"""Which replica most likely holds this prompt's prefix in its KV cache? Consistent hashing with bounded loads.

A request's prefix key (router/requests.py `prefix_key`: the system prompt and first user message of a chat, the
first bytes of a completion prompt) ranks the replicas by rendezvous hashing: every turn of a conversation, and
every request with the same system prompt and opening, ranks the same replica first, so it meets its earlier
turns' KV blocks in that engine's prefix cache. A replica leaving or joining moves only the keys it held.

Pure cache-aware choice lets one hot prefix (a popular system prompt) pin one replica while the others idle.
The bound (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2017) keeps every replica
at most ceil((1 + slack) x the mean load, counting this request): a replica at the bound is passed over for the
next one in the key's order, so a hot prefix spreads and a conversation stays put while the load is even.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from llmdeploy.policies.overflow import load_score
from llmdeploy.policies.snapshot import ReplicaState

ReplicaChoiceMode = Literal["prefix", "least_loaded"]
DEFAULT_SLACK = 0.25


@dataclass(frozen=True)
class ReplicaChoice:
    """How the router orders a revision's replicas (routing.replica_choice, routing.prefix_load_slack)."""

    mode: ReplicaChoiceMode = "prefix"
    slack: float = DEFAULT_SLACK  # eps of the bounded loads: a replica may hold (1 + eps) x the mean

    @classmethod
    def from_spec(cls, spec) -> ReplicaChoice:
        routing = spec.routing
        return cls(routing.replica_choice, routing.prefix_load_slack)


def occupancy(replica: ReplicaState) -> float:
    """Requests on the replica: the engine's running + waiting, or the router's in-flight count if higher."""
    return load_score(replica)[0]


def load_bound(replicas: Sequence[ReplicaState], slack: float) -> int:
    """The most requests any replica may hold once this one is placed: ceil((1 + slack) x mean)."""
    total = sum(occupancy(r) for r in replicas) + 1
    return max(1, math.ceil((1 + slack) * total / max(1, len(replicas))))


def _weight(key: str, replica: ReplicaState) -> bytes:
    # the replica's name, not its URL: a restarted engine on another port keeps its keys
    return hashlib.sha256(f"{key}\0{replica.replica or replica.url}".encode()).digest()


def hash_order(replicas: Sequence[ReplicaState], key: str) -> list[ReplicaState]:
    """Rendezvous order of the replicas for this key (highest weight first)."""
    return sorted(replicas, key=lambda r: _weight(key, r), reverse=True)


def order(
    replicas: Sequence[ReplicaState], key: str | None, choice: ReplicaChoice = ReplicaChoice()
) -> list[ReplicaState]:
    """The replicas to try in order. `replicas` come least loaded first (overflow.least_loaded); without a key
    or in least_loaded mode that order stands. Otherwise: the key's hash order among the replicas under the
    load bound, then those at the bound, least loaded first."""
    ranked = list(replicas)
    if choice.mode != "prefix" or key is None or len(ranked) < 2:
        return ranked
    bound = load_bound(ranked, choice.slack)
    room = [r for r in hash_order(ranked, key) if occupancy(r) + 1 <= bound]
    full = [r for r in ranked if occupancy(r) + 1 > bound]
    return room + full
