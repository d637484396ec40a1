"""JSON schemas that use ``$defs`` and ``$ref`` (recursive ones included), for the tests
that send them through the wire (the producer, the HTTP API, the Batch API): their keys
start with ``$``, which the codec writes with one ``$`` more (docs/protocol.md, Values).

With the tiny random Llama of :func:`~tests.support.models_for_tests.tiny_llama_chars`,
sampling with :data:`SEED` ends each answer (``stop``) within 200 tokens; decoding greedily,
``recursive`` and ``mutual`` recurse until the token limit."""

from __future__ import annotations

from typing import Any

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
