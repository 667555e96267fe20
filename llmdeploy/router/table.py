"""The routing table the control plane fills (docs/CONTRACTS.md section 5): revisions and their engines.

swap() replaces the whole list in one assignment, so a request reads either the old or the new table, never
a mix; requests already in flight keep the endpoint objects they started with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class EngineEndpoint:
    url: str
    replica: str
    ready: bool = True
    token: str | None = field(default=None, repr=False)  # the engine's internal token (never logged)


@dataclass(frozen=True)
class RevisionRoute:
    revision: int
    role: Literal["stable", "candidate"] = "stable"
    percent: float = 100.0
    engines: list[EngineEndpoint] = field(default_factory=list)
    alias: str | None = None  # the model name its engines answer; None: the router's served alias


class RoutingTable:
    def __init__(self, revisions: list[RevisionRoute] | None = None) -> None:
        self._revisions: tuple[RevisionRoute, ...] = tuple(revisions or ())
        self.version = 0  # bumped on every swap; lets pollers notice new engines

    @property
    def revisions(self) -> list[RevisionRoute]:
        return list(self._revisions)

    def swap(self, new: list[RevisionRoute]) -> None:
        self._revisions = tuple(new)
        self.version += 1

    def engines(self) -> list[tuple[int, EngineEndpoint]]:
        return [(r.revision, e) for r in self._revisions for e in r.engines]

    def aliases(self, default: str) -> list[str]:
        """The names clients may send as `model`: every listed revision's (the stable one's first). During a gray
        release that renames the model both names work, each served by whichever revision the split picks."""
        names = [r.alias or default for r in sorted(self._revisions, key=lambda r: r.role != "stable")]
        return list(dict.fromkeys(names)) or [default]

    def alias_of(self, revision: int | None, default: str) -> str:
        route = next((r for r in self._revisions if r.revision == revision), None)
        return (route.alias if route else None) or default
