"""YAML composer nodes -> plain data, keeping where each key sits (for FILE:LINE:COL errors), expanding `${VAR}`
in scalars, refusing duplicate keys, unsupported tags, recursive aliases and alias bombs."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

Loc = tuple[str | int, ...]
MAX_NODES = 100_000  # alias bombs ("billion laughs") end with an error instead of eating memory
ENV_REF = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}|\$\{")
STANDARD_TAGS = {"tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"}


@dataclass(frozen=True)
class SpecIssue:
    file: str
    line: int  # 1-based
    col: int  # 1-based
    path: str  # dotted, list indices as [i]; "" for the file as a whole
    message: str

    def format(self, severity: str | None = None) -> str:
        where = f"{self.file}:{self.line}:{self.col}: "
        label = f"{severity}: " if severity else ""
        return f"{where}{label}{self.path + ': ' if self.path else ''}{self.message}"


def dotted(loc: Iterable[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def issue_at(filename: str, mark: yaml.Mark, loc: Loc, message: str) -> SpecIssue:
    return SpecIssue(filename, mark.line + 1, mark.column + 1, dotted(loc), message)


class NodeReader:
    """Composer nodes -> plain data, recording where each key sits and which values are already wrong."""

    def __init__(self, filename: str, env: Mapping[str, str]):
        self.filename, self.env = filename, env
        self.marks: dict[Loc, yaml.Mark] = {}
        self.errors: list[SpecIssue] = []
        self.bad: set[Loc] = set()
        self._constructor = yaml.SafeLoader("")
        self._open: set[int] = set()
        self._nodes = 0
        self.too_big = False

    def error(self, mark: yaml.Mark, loc: Loc, message: str) -> None:
        self.errors.append(issue_at(self.filename, mark, loc, message))
        self.bad.add(loc)

    def value(self, node: yaml.Node, loc: Loc) -> Any:
        self._nodes += 1
        if self._nodes > MAX_NODES:
            if not self.too_big:
                self.too_big = True
                self.error(node.start_mark, loc, f"more than {MAX_NODES} values after expanding aliases")
            return None
        if isinstance(node, yaml.ScalarNode):
            return self.scalar(node, loc)
        if node.tag not in STANDARD_TAGS:
            self.error(node.start_mark, loc, f"YAML tag {node.tag} is not supported here")
            return None
        if id(node) in self._open:
            self.error(node.start_mark, loc, "recursive alias: a value may not contain itself")
            return None
        self._open.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                return self.mapping(node, loc)
            items = []
            for i, item in enumerate(node.value):
                self.marks.setdefault(loc + (i,), item.start_mark)
                items.append(self.value(item, loc + (i,)))
            return items
        finally:
            self._open.discard(id(node))

    def mapping(self, node: yaml.MappingNode, loc: Loc) -> dict[str, Any]:
        self.marks.setdefault(loc, node.start_mark)
        seen: dict[str, yaml.Mark] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    first = seen[key_node.value].line + 1
                    self.error(
                        key_node.start_mark,
                        loc + (key_node.value,),
                        f"duplicate key '{key_node.value}' (first at line {first}, column {seen[key_node.value].column + 1})",
                    )
                seen.setdefault(key_node.value, key_node.start_mark)
        try:
            self._constructor.flatten_mapping(node)  # YAML merge keys (<<: *anchor)
        except yaml.MarkedYAMLError as e:
            self.error(e.problem_mark or node.start_mark, loc, f"bad merge key: {e.problem}")
            return {}
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not (isinstance(key_node, yaml.ScalarNode) and key_node.tag == "tag:yaml.org,2002:str"):
                raw = key_node.value if isinstance(key_node, yaml.ScalarNode) else "..."
                self.error(key_node.start_mark, loc + (str(raw),), f"key {raw!r} must be text (quote it)")
                continue
            key = key_node.value
            self.marks[loc + (key,)] = key_node.start_mark
            out[key] = self.value(value_node, loc + (key,))
        return out

    def scalar(self, node: yaml.ScalarNode, loc: Loc) -> Any:
        if node.tag == "tag:yaml.org,2002:str" and "$" in node.value:
            text = self.expand(node, loc)
            if text is None:
                return None
            if node.style is not None:  # quoted: stays text
                return text
            # plain: as if the value had been written there, so `replicas: ${N}` is a number
            tag = self._constructor.resolve(yaml.ScalarNode, text, (True, False))
            node = yaml.ScalarNode(tag, text, node.start_mark, node.end_mark)
        try:
            return self._constructor.construct_object(node, deep=True)
        except yaml.MarkedYAMLError as e:
            self.error(node.start_mark, loc, e.problem or str(e))
        except (ValueError, TypeError):  # the exception quotes the value: it might be a secret
            self.error(node.start_mark, loc, f"cannot read this value as {node.tag.rsplit(':', 1)[-1]}")
        return None

    def expand(self, node: yaml.ScalarNode, loc: Loc) -> str | None:
        """${NAME} and ${NAME:-default} from the environment; $$ is a literal $. None when unexpandable."""
        ok = True

        def sub(m: re.Match) -> str:
            nonlocal ok
            if m.group(0) == "$$":
                return "$"
            name = m.group("name")
            if name is None:
                ok = False
                self.error(
                    node.start_mark,
                    loc,
                    "malformed variable reference: write ${NAME} or ${NAME:-default} ($$ for a literal $)",
                )
                return ""
            value = self.env.get(name)
            if value is None or (value == "" and m.group("default") is not None):
                if m.group("default") is not None:
                    return m.group("default")
                ok = False
                self.error(
                    node.start_mark,
                    loc,
                    f"environment variable {name} is not set (set it, or write ${{{name}:-default}})",
                )
                return ""
            return value

        text = ENV_REF.sub(sub, node.value)
        return text if ok else None
