"""JSON schemas the structured-output tests share (response_format's)."""

from __future__ import annotations

from typing import Any

__all__ = ["GOOD", "HUGE_PATTERN", "LAZY", "TREE", "json_schema", "strict"]

#: Its lexer gives up on the first character of the string (too many expressions): the
#: grammar compiles and gives its first mask, then fails.
HUGE_PATTERN: dict[str, Any] = {"type": "string", "pattern": "^a{1000000}$"}
#: The same string behind an optional property: the shortest value, {}, never reaches it,
#: so it passes every check, and fails as a model writes the property.
LAZY: dict[str, Any] = {
    "type": "object",
    "properties": {"zz": HUGE_PATTERN},
    "additionalProperties": False,
}
GOOD: dict[str, Any] = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
    "required": ["color", "n"],
    "additionalProperties": False,
}
#: A recursive definition: a tree of nodes.
TREE: dict[str, Any] = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["v", "kids"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` as a ``response_format``."""
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def strict(**props: Any) -> dict[str, Any]:
    """An object of ``props``, each required, no other property allowed."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }
