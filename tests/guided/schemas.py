"""Thirty-odd JSON schemas of the kinds clients send (OpenAI structured outputs, extraction, tool arguments):
nested objects, arrays with bounds, enums, consts, formats of numbers, optional fields, anyOf, refs."""

from __future__ import annotations

from typing import Any

S = {"type": "string"}
I = {"type": "integer"}  # noqa: E741
N = {"type": "number"}
B = {"type": "boolean"}


def obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


SCHEMAS: list[dict[str, Any]] = [
    obj({"name": S}),
    obj({"name": S, "age": I}),
    obj({"ok": B}),
    obj({"x": N, "y": N}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"kind": {"const": "point"}, "x": I}),
    obj({"tags": {"type": "array", "items": S, "maxItems": 3}}),
    obj({"ids": {"type": "array", "items": I, "minItems": 1, "maxItems": 4}}),
    obj({"name": {"type": "string", "maxLength": 12}}),
    obj({"code": {"type": "string", "minLength": 2, "maxLength": 5}}),
    obj({"n": {"type": "integer", "minimum": 0, "maximum": 100}}),
    obj({"n": {"type": "integer", "minimum": -5, "maximum": 5}}),
    obj({"p": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"name": S, "nick": S}, required=["name"]),
    obj({"a": obj({"b": obj({"c": I})})}),
    obj({"user": obj({"name": S, "admin": B}), "score": N}),
    obj({"items": {"type": "array", "items": obj({"sku": S, "qty": I}), "maxItems": 2}}),
    obj({"v": {"anyOf": [I, S]}}),
    obj({"v": {"anyOf": [{"type": "null"}, I]}}),
    obj({"v": {"type": ["string", "null"]}}),
    obj({"when": {"type": "string", "format": "date"}}),
    obj({"id": {"type": "string", "format": "uuid"}}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    obj({"flags": {"type": "array", "items": B, "minItems": 2, "maxItems": 2}}),
    obj({"pair": {"type": "array", "prefixItems": [S, I], "items": False}}),
    obj({"level": {"enum": [1, 2, 3]}, "label": S}),
    obj({"empty": obj({})}),
    {
        "$defs": {"node": obj({"value": I})},
        **obj(
            {
                "root": {"$ref": "#/$defs/node"},
                "rest": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            }
        ),
    },
    {"type": "array", "items": I, "maxItems": 3},
    {"enum": ["yes", "no"]},
    {"type": "string", "maxLength": 8},
    {"type": "integer"},
    obj({"location": S, "unit": {"enum": ["celsius", "fahrenheit"]}}, required=["location"]),
    obj({"zeta": I, "alpha": B, "mid": {"enum": ["x", "y"]}}),  # not in alphabetical order
]
