"""Schemas with ``$ref`` and ``$defs``: shared and recursive definitions compile (under the
same limits in the API's check and the worker's), and the in-process generator's answers
validate against them; loops with no value, and definitions whose expansion would blow up,
are refused naming why, in bounded time."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batchline._response_format import check_response_format, grammar_of
from batchline.errors import BadGenerationParams
from batchline.generation import Engine, GenerationParams, SyncGenerator

from tests.support.models_for_tests import char_tokenizer
from tests.support.schemas import TREE, json_schema
from tests.support.tiny import tiny_model

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SHARED = {
    "$defs": {
        "point": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
#: A loop through anyOf with a way out (null).
ANY_OF_LOOP = {
    "$defs": {
        "list": {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "properties": {"head": {"type": "boolean"}, "tail": {"$ref": "#/$defs/list"}},
                    "required": ["head", "tail"],
                    "additionalProperties": False,
                },
            ]
        }
    },
    "$ref": "#/$defs/list",
}
#: Mutual recursion through definitions (legacy ``definitions``) with a way out.
MUTUAL = {
    "definitions": {
        "a": {"type": "array", "items": {"$ref": "#/definitions/b"}, "maxItems": 2},
        "b": {"anyOf": [{"type": "string", "maxLength": 3}, {"$ref": "#/definitions/a"}]},
    },
    "$ref": "#/definitions/a",
}
USABLE = [TREE, SHARED, ANY_OF_LOOP, MUTUAL]


def exploding(depth: int) -> dict[str, Any]:
    """Each definition the allOf of two anyOfs over the one before: the JSON compiler must
    multiply the branches out (4 ** depth of them)."""
    defs: dict[str, Any] = {"d0": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    for i in range(1, depth):
        defs[f"d{i}"] = {
            "allOf": [
                {"anyOf": [{"$ref": f"#/$defs/d{i - 1}"}, {"properties": {f"x{i}": {}}}]},
                {"anyOf": [{"$ref": f"#/$defs/d{i - 1}"}, {"properties": {f"y{i}": {}}}]},
            ]
        }
    return {"$defs": defs, "$ref": f"#/$defs/d{depth - 1}"}


@pytest.mark.parametrize("schema", USABLE, ids=["tree", "shared", "any_of_loop", "mutual"])
def test_recursive_and_shared_definitions_are_answered_and_validate(
    schema: dict[str, Any],
) -> None:
    assert check_response_format(json_schema(schema)) is not None  # the API's check
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    with SyncGenerator(model, tokenizer=tokenizer) as gen:
        results = [
            gen.generate(
                prompt_ids=[5 + i, 6],
                max_new_tokens=60,
                response_format=json_schema(schema),
                **({"temperature": 1.0, "seed": i} if i else {}),
            )
            for i in range(3)
        ]
    for result in results:
        jsonschema.validate(json.loads(result.text), schema)


@pytest.mark.parametrize("depth", [4, 8])
def test_definitions_that_would_blow_up_are_refused_by_a_limit(depth: int) -> None:
    """Refused by the API's check and by the worker's compile alike, by llguidance's bound on
    the grammar's size or its lexer's fuel (about a second at most on a 2-core machine)."""
    with pytest.raises(BadGenerationParams, match="too big|too large") as api:
        check_response_format(json_schema(exploding(depth)))
    engine = Engine(tiny_model("llama"), char_tokenizer())
    with pytest.raises(BadGenerationParams, match="too big|too large") as worker:
        engine.check([5], GenerationParams(grammar=grammar_of(json_schema(exploding(depth)))))
    assert "response_format" in str(api.value)
    assert "response_format" in str(worker.value)
