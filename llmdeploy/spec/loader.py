"""Read an llmdeploy.yaml into a DeploymentSpec and locate every problem at FILE:LINE:COL.

pyyaml's composer keeps each node's position; we build plain data from the nodes ourselves (expanding
`${VAR}` in scalars, refusing duplicate keys), let pydantic judge it, and map each pydantic error back to
the line of its key. Errors are collected, never raised, so a file's problems are reported all at once:
values already reported as wrong are dropped (their defaults apply) and the spec is validated again, which
lets rules that pydantic only checks on otherwise-valid sections speak too.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from llmdeploy.spec.addresses import is_loopback
from llmdeploy.spec.annotations import (
    annotation_at,
    described,
    fields_at,
    literal_choices,
    union_branches,
    without_branch_names,
)
from llmdeploy.spec.model_shape import ModelShapeError, read_model_shape
from llmdeploy.spec.models import DeploymentSpec, RuleError, not_yet_supported
from llmdeploy.spec.parallel import tensor_parallel_problem
from llmdeploy.spec.sources import ModelSource, ModelSourceError, resolve_model_source
from llmdeploy.spec.yaml_nodes import Loc, NodeReader, SpecIssue, dotted, issue_at

MAX_PASSES = 4
GENERATED_KEY = "apply will generate a key, print it once and keep only its sha256"


class SpecFileError(Exception):
    """The file cannot be read at all (missing, a directory, not text): not an invalid spec, exit code 1."""


@dataclass
class SpecResult:
    spec: DeploymentSpec | None
    errors: list[SpecIssue] = field(default_factory=list)
    warnings: list[SpecIssue] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.spec is not None and not self.errors


def load_spec_file(path: str | os.PathLike, env: Mapping[str, str] | None = None) -> SpecResult:
    """Load and validate a YAML file; relative paths inside it are resolved against its folder."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SpecFileError(f"{path}: is a directory, not a YAML file") from None
    except UnicodeDecodeError as e:
        raise SpecFileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise SpecFileError(f"{path}: cannot read: {e.strerror or e}") from None
    return load_spec_text(text, str(path), base_dir=p.resolve().parent, env=env)


def load_spec_text(
    text: str, filename: str = "<string>", base_dir: Path | None = None, env: Mapping[str, str] | None = None
) -> SpecResult:
    env = os.environ if env is None else env
    base_dir = Path.cwd() if base_dir is None else base_dir
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = " ".join(p for p in (e.problem, e.context) if p)
        return _failed(filename, mark, f"YAML syntax error: {problem}")
    except yaml.YAMLError as e:
        return _failed(filename, None, f"YAML error: {e}")
    if root is None:
        return _failed(filename, None, "the file is empty; start from llmdeploy.yaml.example")
    if not isinstance(root, yaml.MappingNode):
        return _failed(
            filename, root.start_mark, "the file must be a mapping of settings (name:, model:, ...)"
        )
    reader = NodeReader(filename, env)
    data = reader.mapping(root, ())
    if reader.too_big:
        return SpecResult(None, reader.errors)
    return _Validation(filename, reader, data, base_dir, env).run()


def _failed(filename: str, mark: yaml.Mark | None, message: str) -> SpecResult:
    """The file as a whole is unusable: one error, no spec."""
    line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
    return SpecResult(None, [SpecIssue(filename, line, col, "", message)])


class _Validation:
    """pydantic passes over the data, then checks that need the file system, then warnings."""

    def __init__(self, filename: str, reader: NodeReader, data: dict, base_dir: Path, env: Mapping[str, str]):
        self.filename, self.reader, self.data, self.base_dir, self.env = filename, reader, data, base_dir, env
        self.errors = list(reader.errors)
        self.pruned: set[Loc] = {_prune_point(loc) for loc in reader.bad}

    def run(self) -> SpecResult:
        spec = self.validate()
        if spec is not None:
            self.check_files(spec)
        warnings = self.warnings(spec) if spec is not None else []
        self.errors.sort(key=lambda i: (i.line, i.col))
        if self.errors:
            return SpecResult(None, self.errors, warnings)
        return SpecResult(spec, [], warnings)

    def at(self, loc: Loc, message: str) -> SpecIssue:
        for n in range(len(loc), -1, -1):  # a missing key: its parent mapping
            if loc[:n] in self.reader.marks:
                return issue_at(self.filename, self.reader.marks[loc[:n]], loc, message)
        return SpecIssue(self.filename, 1, 1, dotted(loc), message)

    def validate(self) -> DeploymentSpec | None:
        """The spec, or the best one left after dropping every value reported as wrong (then errors is non-empty)."""
        for _ in range(MAX_PASSES):
            data = _without(self.data, self.pruned)
            try:
                return DeploymentSpec.model_validate(data)
            except ValidationError as e:
                known = frozenset(self.pruned)  # judge this pass's errors by what earlier passes dropped
                for err in e.errors():
                    self.take(err, known)
                if self.pruned == known:
                    return None
        return None

    def take(self, err: dict, known: frozenset[Loc]) -> None:
        loc = without_branch_names(tuple(err["loc"]))
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, RuleError):
            reads = [loc + tuple(f.split(".")) for f in (cause.field, *cause.involves) if f]
            if cause.field:
                loc = loc + tuple(cause.field.split("."))
            if any(_overlaps(r, p) for r in reads for p in known):
                if _prune_point(loc):
                    self.pruned.add(_prune_point(loc))
                return
        if not any(_overlaps(loc, p) for p in known):
            self.errors.append(self.at(loc, _message(err, loc)))
        point = _prune_point(loc[:-1] if err["type"] == "missing" else loc)
        if point:  # the root itself cannot be dropped; validate() then stops
            self.pruned.add(point)

    def check_files(self, spec: DeploymentSpec) -> None:
        """Paths in the spec exist; relative ones are made absolute against the YAML file's folder."""
        if not _is_pruned(("model", "path"), self.pruned):
            try:
                source = resolve_model_source(spec.model.path, self.base_dir)
                if not spec.model.path.startswith("builtin:"):
                    spec.model.path = str(source.path)
                self.check_tensor_parallel(spec, source)
            except ModelSourceError as e:
                self.errors.append(self.at(("model", "path"), str(e)))
        for section, key in (("tls", "cert_file"), ("tls", "key_file"), ("cloud", "ca_file")):
            value = getattr(getattr(spec, section), key)
            if value is None or _is_pruned((section, key), self.pruned):
                continue
            p = (self.base_dir / Path(value).expanduser()).resolve()
            if p.is_file():
                setattr(getattr(spec, section), key, str(p))
            else:
                self.errors.append(self.at((section, key), f"file {value} does not exist (resolved to {p})"))

    def check_tensor_parallel(self, spec: DeploymentSpec, source: ModelSource) -> None:
        """Every rank takes whole attention and KV heads; the model's config (not its weights) says how many."""
        tp = spec.parallel.tensor_parallel
        if tp == 1 or _is_pruned(("parallel", "tensor_parallel"), self.pruned):
            return
        try:
            shape = read_model_shape(source)
        except ModelShapeError:
            return  # the engine reports an unreadable model when it loads it
        if problem := tensor_parallel_problem(tp, shape.num_heads, shape.num_kv_heads):
            self.errors.append(self.at(("parallel", "tensor_parallel"), problem))

    def warnings(self, spec: DeploymentSpec) -> list[SpecIssue]:
        """Legal but risky, or fixed up by apply; never prints a secret, only variable names."""
        out: list[tuple[Loc, str]] = []
        if not is_loopback(spec.listen_host) and not spec.tls.enabled:
            out.append(
                (
                    ("listen",),
                    f"{spec.listen} is reachable from other machines over plain HTTP: keys and prompts "
                    "cross the network unencrypted; set tls.cert_file and tls.key_file",
                )
            )
        if spec.auth.api_key_required:
            if not spec.auth.keys:
                where = (
                    ("auth", "api_key_required")
                    if ("auth", "api_key_required") in self.reader.marks
                    else ("auth",)
                )
                out.append((where, f"auth is required but no keys are configured; {GENERATED_KEY}"))
            for i, key in enumerate(spec.auth.keys):
                if key.key_env and not self.env.get(key.key_env):
                    out.append(
                        (
                            ("auth", "keys", i, "key_env"),
                            f"environment variable {key.key_env} is not set; {GENERATED_KEY}",
                        )
                    )
        if spec.cloud.enabled and spec.cloud.api_key_env and not self.env.get(spec.cloud.api_key_env):
            out.append(
                (
                    ("cloud", "api_key_env"),
                    f"environment variable {spec.cloud.api_key_env} is not set; "
                    "requests cannot go to the cloud until it is",
                )
            )
        if found := not_yet_supported(spec):
            out.append((found[0], f"{found[1]} (apply refuses it)"))
        return [self.at(loc, msg) for loc, msg in out if not any(_overlaps(loc, p) for p in self.pruned)]


def _message(err: dict, loc: Loc) -> str:
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        name = str(loc[-1])
        known = sorted(fields_at(loc[:-1]))
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        return f"unknown key '{name}'; " + (
            f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
        )
    if kind == "missing":
        return f"required key '{loc[-1]}' is missing"
    if kind in ("int_type", "int_parsing") and (branches := union_branches(annotation_at(loc))):
        return "must be " + " or ".join(described(b) for b in branches.values())
    if kind == "model_type":
        return "must be a mapping of keys (a section), not a single value"
    if kind == "literal_error" and isinstance(err.get("input"), str):
        choices = [str(c) for c in literal_choices(loc)]
        close = difflib.get_close_matches(err["input"], choices, n=1, cutoff=0.5)
        if close:
            msg += f"; did you mean '{close[0]}'?"
    msg = msg.removeprefix("Value error, ")
    return msg.replace("Input should be", "must be", 1)


def _prune_point(loc: Loc) -> Loc:
    """Dropping a list item would renumber the others, so a bad item drops its whole list."""
    while loc and isinstance(loc[-1], int):
        loc = loc[:-1]
    return loc


def _overlaps(a: Loc, b: Loc) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def _is_pruned(loc: Loc, pruned: set[Loc]) -> bool:
    return any(loc[: len(p)] == p for p in pruned)


def _without(data: Any, pruned: set[Loc], loc: Loc = ()) -> Any:
    """A copy of data with the pruned keys (and lists) left out, so their defaults apply."""
    if isinstance(data, dict):
        return {k: _without(v, pruned, loc + (k,)) for k, v in data.items() if loc + (k,) not in pruned}
    if isinstance(data, list):
        return [_without(v, pruned, loc + (i,)) for i, v in enumerate(data)]
    return data
