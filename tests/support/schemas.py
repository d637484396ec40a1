"""JSON schemas the structured-output tests share (a ``response_format``'s).

:data:`DEFS_SCHEMAS` use ``$defs`` and ``$ref`` (recursive ones included), for the tests
that send them through the wire (the producer, the HTTP API, the Batch API): their keys
start with ``$``, which the codec writes with one ``$`` more (docs/protocol.md, Values).
With the tiny random Llama of :func:`~tests.support.models_for_tests.tiny_llama_chars`,
sampling with :data:`SEED` ends each answer (``stop``) within 200 tokens; decoding greedily,
``recursive`` and ``mutual`` recurse until the token limit.

The others are for containment (:data:`HUGE_PATTERN`, :data:`LAZY`: schemas whose grammar
fails) and the closing of an answer's JSON."""

from __future__ import annotations

from typing import Any

__all__ = [
    "DEFS_SCHEMAS",
    "GOOD",
    "HUGE_PATTERN",
    "LAZY",
    "SEED",
    "TREE",
    "json_schema",
    "json_schema_format",
    "strict",
]

SEED = 3

_NODE = {
    "type": "object",
    "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9},
        "next": {"$ref": "#/$defs/node"},
    },
    "required": ["v"],
    "additionalProperties": False,
}
_A = {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "additionalProperties": False}
_B = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/a"}, "x": {"type": "boolean"}},
    "required": ["x"],
    "additionalProperties": False,
}
_TREE = {
    "anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 9},
        {"type": "array", "items": {"$ref": "#/$defs/tree"}, "maxItems": 2},
    ]
}

#: By name: a linked list through ``$defs``; a schema whose property refers to the root
#: (``#``); two definitions referring to each other; a tree through ``anyOf``.
DEFS_SCHEMAS: dict[str, dict[str, Any]] = {
    "recursive": {"$defs": {"node": _NODE}, "$ref": "#/$defs/node"},
    "self_loop": {
        "type": "object",
        "properties": {"n": {"type": "boolean"}, "child": {"$ref": "#"}},
        "required": ["n"],
        "additionalProperties": False,
    },
    "mutual_loop": {"$defs": {"a": _A, "b": _B}, "$ref": "#/$defs/a"},
    "any_of_loop": {"$defs": {"tree": _TREE}, "$ref": "#/$defs/tree"},
}


def json_schema_format(name: str) -> dict[str, Any]:
    """OpenAI's ``response_format`` asking for :data:`DEFS_SCHEMAS`' ``name``."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": DEFS_SCHEMAS[name]}}


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
