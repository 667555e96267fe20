"""The README's YAML reference, generated from the spec models so that it cannot drift from them.

python -m llmdeploy.spec.reference            # print the table
python -m llmdeploy.spec.reference --write    # replace it in README.md between the markers
python -m llmdeploy.spec.reference --check    # exit 1 when README.md is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from llmdeploy.spec.annotations import plain
from llmdeploy.spec.models import DeploymentSpec

START = "<!-- yaml-reference:start -->"
END = "<!-- yaml-reference:end -->"
README = Path(__file__).resolve().parents[2] / "README.md"
TYPE_NAMES = {str: "text", int: "integer", float: "number", bool: "bool"}
BOUNDS = ((at.Ge, ">=", "ge"), (at.Gt, ">", "gt"), (at.Le, "<=", "le"), (at.Lt, "<", "lt"))


def field_rows(
    model: type[BaseModel] = DeploymentSpec, prefix: str = ""
) -> Iterator[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) for every setting, depth first in declaration order."""
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = _optional_inner(info.annotation)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from field_rows(ann, key + ".")
            continue
        item = _list_item(ann)
        yield key, _type_name(info), _default(info), _cell(info.description or "")
        if item is not None:
            yield from field_rows(item, key + "[].")
        for branch in _section_branches(ann):  # a value or a section (parallel.replicas): the section's keys
            yield from field_rows(branch, key + ".")


def render_reference() -> str:
    lines = [
        "| key | type | default | meaning |",
        "|---|---|---|---|",
        *(f"| `{k}` | {t} | {d} | {m} |" for k, t, d, m in field_rows()),
    ]
    return "\n".join(lines)


def splice(readme: str, table: str) -> str:
    """readme with the text between the markers replaced by table."""
    head, sep, rest = readme.partition(START)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"README has no {START} ... {END} block")
    return f"{head}{START}\n{table}\n{END}{tail}"


def _cell(text: str) -> str:
    """Markdown-table-safe: pipes escaped, <name> not taken for an HTML tag."""
    return re.sub(r"<(?=[A-Za-z/!?])", "&lt;", text.replace("|", "\\|"))


def _optional_inner(ann: Any) -> Any:
    if typing.get_origin(ann) in (Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return ann


def _list_item(ann: Any) -> type[BaseModel] | None:
    if typing.get_origin(ann) is list:
        (item,) = typing.get_args(ann)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item
    return None


def _section_branches(ann: Any) -> list[type[BaseModel]]:
    """The sections among a union's branches (Annotated[...] unwrapped)."""
    if typing.get_origin(ann) not in (Union, types.UnionType):
        return []
    branches = (plain(a) for a in typing.get_args(ann))
    return [b for b in branches if isinstance(b, type) and issubclass(b, BaseModel)]


def _type_name(info: FieldInfo) -> str:
    ann = info.annotation
    nullable = typing.get_origin(ann) in (Union, types.UnionType) and type(None) in typing.get_args(ann)
    ann = _optional_inner(ann)
    if _section_branches(ann):  # e.g. `integer, >= 1, or {min, max, ...}`
        return ", or ".join(_branch_name(a) for a in typing.get_args(ann)) + (" or null" if nullable else "")
    if typing.get_origin(ann) is Literal:
        name = " \\| ".join(f"`{a}`" for a in typing.get_args(ann))
    elif _list_item(ann) is not None:
        name = "list"
    else:
        name = TYPE_NAMES.get(ann, getattr(ann, "__name__", str(ann)))
    bounds = [
        f"{op} {getattr(m, attr):g}" for m in info.metadata for cls, op, attr in BOUNDS if isinstance(m, cls)
    ]
    if bounds:
        name += ", " + ", ".join(bounds)
    return name + (" or null" if nullable else "")


def _branch_name(ann: Any) -> str:
    """One branch of a union: a section by its keys, a value like a field of that type."""
    inner = plain(ann)
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return "{" + ", ".join(inner.model_fields) + "}"
    return _type_name(FieldInfo.from_annotation(ann))


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    return f"`{value}`" if isinstance(value, str) else f"`{json.dumps(value)}`"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Generate the README's YAML reference from the spec models.")
    ap.add_argument("--write", action="store_true", help="replace the table in the README")
    ap.add_argument("--check", action="store_true", help="exit 1 when the README's table is out of date")
    ap.add_argument("--readme", type=Path, default=README)
    args = ap.parse_args(argv)
    table = render_reference()
    if not (args.write or args.check):
        print(table)
        return 0
    current = args.readme.read_text(encoding="utf-8")
    updated = splice(current, table)
    if args.check:
        if updated != current:
            print(
                f"{args.readme}: YAML reference is out of date; run python -m llmdeploy.spec.reference --write"
            )
            return 1
        return 0
    if updated != current:
        args.readme.write_text(updated, encoding="utf-8")
        print(f"{args.readme}: YAML reference updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
