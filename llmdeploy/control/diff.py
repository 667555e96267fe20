"""What an apply changes: the normalised spec diffed against the last applied one, each change classified.

hot-reload    auth, routing, sla, cloud, rollout, logging: the router takes the new spec in place
              (Router.update_spec), in-flight and new requests keep being served.
new-revision  model, engine, parallel: new engine processes start beside the stable revision and take
              rollout.canary_percent of the traffic once ready.
restart       listen, tls: the daemon opens the router on the new address first, then drains the old
              listener; engines keep running. (`name` is the state directory's key: a file with another
              name is another deployment, so it never shows up in a diff.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from llmdeploy.spec.models import DeploymentSpec

ChangeKind = Literal["hot-reload", "new-revision", "restart"]
KIND_OF_SECTION: dict[str, ChangeKind] = {
    **dict.fromkeys(("auth", "routing", "sla", "cloud", "rollout", "logging"), "hot-reload"),
    **dict.fromkeys(("model", "engine", "parallel"), "new-revision"),
    **dict.fromkeys(("listen", "tls", "name"), "restart"),
}


@dataclass(frozen=True)
class Change:
    path: str  # dotted, e.g. engine.max_num_seqs
    old: Any
    new: Any
    kind: ChangeKind


@dataclass(frozen=True)
class SpecDiff:
    changes: tuple[Change, ...]
    created: bool = False  # nothing applied before: everything is new

    @property
    def unchanged(self) -> bool:
        return not self.created and not self.changes

    @property
    def kinds(self) -> set[ChangeKind]:
        return {c.kind for c in self.changes}

    @property
    def new_revision(self) -> bool:
        return self.created or "new-revision" in self.kinds

    @property
    def hot_reload(self) -> bool:
        return "hot-reload" in self.kinds

    @property
    def restart(self) -> bool:
        return "restart" in self.kinds

    def summary(self) -> str:
        if self.created:
            return "new deployment"
        if not self.changes:
            return "unchanged"
        words = {"new-revision": "new revision", "hot-reload": "hot reload", "restart": "router re-listen"}
        return ", ".join(words[k] for k in ("new-revision", "restart", "hot-reload") if k in self.kinds)

    def lines(self) -> list[str]:
        """For `plan`/`apply --dry-run`: '-' old value, '+' new value, each change tagged with what apply does."""
        if self.created:
            return ["+ new deployment: revision 1 starts with this spec"]
        out: list[str] = []
        for c in self.changes:
            out += [f"- {c.path}: {_show(c.old)}", f"+ {c.path}: {_show(c.new)}    ({c.kind})"]
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "created": self.created,
            "changes": [{"path": c.path, "old": c.old, "new": c.new, "kind": c.kind} for c in self.changes],
        }


def diff_specs(old: DeploymentSpec | dict[str, Any] | None, new: DeploymentSpec | dict[str, Any]) -> SpecDiff:
    if old is None:
        return SpecDiff((), created=True)
    a, b = _as_dict(old), _as_dict(new)
    changes = [
        Change(path, x, y, KIND_OF_SECTION.get(path.split(".")[0], "hot-reload"))
        for path, x, y in _walk(a, b, "")
    ]
    return SpecDiff(tuple(changes))


def _as_dict(spec: DeploymentSpec | dict[str, Any]) -> dict[str, Any]:
    # through the model either way, so defaults are filled and a stored dict compares like a fresh spec
    if isinstance(spec, dict):
        spec = DeploymentSpec.model_validate(spec)
    return spec.model_dump(mode="json")


def _walk(a: Any, b: Any, prefix: str):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            yield from _walk(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)
    elif a != b:
        yield prefix, a, b


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value
