"""The spec models' type annotations, walked by a YAML path (("parallel", "replicas", "min")): what the loader
needs to word an error (the keys known at a path, a Literal's choices, a union's branches) and to point at the
file's own keys when pydantic names a union's branch in an error's location."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Tag

from llmdeploy.spec.models import DeploymentSpec

Loc = tuple[str | int, ...]


def annotation_at(loc: Loc) -> Any:
    ann: Any = DeploymentSpec
    for part in loc:
        ann = step(ann, part)
    return ann


def step(ann: Any, part: str | int) -> Any:
    """The annotation one key (or list index) below `ann`; Any where the models do not say."""
    ann = unwrap(ann)
    if isinstance(part, int):
        args = typing.get_args(ann)
        return args[0] if args else Any
    if isinstance(ann, type) and issubclass(ann, BaseModel) and part in ann.model_fields:
        return ann.model_fields[part].annotation
    return Any


def without_branch_names(loc: Loc) -> Loc:
    """pydantic names the branch of a discriminated union in an error's location (parallel.replicas.range.min);
    the file has no such key, so the branch name is dropped (parallel.replicas.min)."""
    ann: Any = DeploymentSpec
    out: list[str | int] = []
    for part in loc:
        branches = union_branches(ann)
        if isinstance(part, str) and part in branches:
            ann = branches[part]
            continue
        out.append(part)
        ann = step(ann, part)
    return tuple(out)


def union_branches(ann: Any) -> dict[str, Any]:
    """A tagged union's branches by tag (Annotated[X, Tag("t")] | ...); {} for anything else."""
    out: dict[str, Any] = {}
    if typing.get_origin(ann) in (Union, types.UnionType):
        for arg in typing.get_args(ann):
            if typing.get_origin(arg) is Annotated:
                inner, *meta = typing.get_args(arg)
                out.update({m.tag: inner for m in meta if isinstance(m, Tag)})
    return out


def unwrap(ann: Any) -> Any:
    """X | None -> X; a count-or-section union (int | Section) -> the section, whose keys the file may hold."""
    if typing.get_origin(ann) in (Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
        models = [a for a in (plain(a) for a in args) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else ann
    return ann


def described(ann: Any) -> str:
    """One branch of a union, as the error message names it."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "a mapping {" + ", ".join(ann.model_fields) + "}"
    return "an integer" if ann is int else getattr(ann, "__name__", str(ann))


def plain(ann: Any) -> Any:
    """Annotated[X, ...] -> X."""
    return typing.get_args(ann)[0] if typing.get_origin(ann) is Annotated else ann


def fields_at(loc: Loc) -> list[str]:
    ann = unwrap(annotation_at(loc))
    return list(ann.model_fields) if isinstance(ann, type) and issubclass(ann, BaseModel) else []


def literal_choices(loc: Loc) -> tuple:
    ann = unwrap(annotation_at(loc))
    return typing.get_args(ann) if typing.get_origin(ann) is Literal else ()
