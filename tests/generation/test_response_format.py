"""A schema's numbers bounded before it becomes a grammar: what is added, what is left alone,
and that what the grammar then admits still validates against the schema as given."""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

import pytest

from batchline._response_format import (
    MAX_FRACTION_DIGITS,
    MAX_SAFE_INTEGER,
    bounded_numbers,
    grammar_of,
)
from batchline.errors import BadGenerationParams
from batchline.generation import GenerationParams
from batchline.generation._grammar import Grammars
from batchline.generation._types import Sequence_

from tests.support.models_for_tests import char_tokenizer
from tests.support.tiny import torch

STEP = 10.0**-MAX_FRACTION_DIGITS
CAP = {"minimum": -MAX_SAFE_INTEGER, "maximum": MAX_SAFE_INTEGER}


def test_numbers_without_bounds_get_the_cap_and_a_fraction_step_wherever_they_are() -> None:
    number, integer = {"type": "number"}, {"type": "integer"}
    schema = {
        "type": "object",
        "properties": {
            "p": {"type": "number", "minimum": 0, "maximum": 1},
            "n": integer,
            "list": {"type": "array", "items": number},
            "pair": {"type": "array", "prefixItems": [integer, number], "items": False},
            "either": {"anyOf": [{"$ref": "#/$defs/x"}, {"type": "string"}]},
            "maybe": {"type": ["number", "null"], "exclusiveMinimum": -1},
            "name": {"type": "string", "maxLength": 3},
        },
        "additionalProperties": number,
        "$defs": {"x": {"type": "integer", "maximum": 5}},
    }
    given = copy.deepcopy(schema)
    out = bounded_numbers(schema)
    assert schema == given  # the input is not changed
    props = out["properties"]
    assert props["p"] == {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": STEP}
    assert props["n"] == {"type": "integer", **CAP}
    assert props["list"]["items"] == {"type": "number", **CAP, "multipleOf": STEP}
    assert props["pair"]["prefixItems"] == [
        {"type": "integer", **CAP},
        {"type": "number", **CAP, "multipleOf": STEP},
    ]
    assert props["either"] == schema["properties"]["either"]  # the $ref is followed via $defs
    assert out["$defs"]["x"] == {"type": "integer", "maximum": 5, "minimum": -MAX_SAFE_INTEGER}
    assert props["maybe"] == {
        "type": ["number", "null"],
        "exclusiveMinimum": -1,
        "maximum": MAX_SAFE_INTEGER,
        "multipleOf": STEP,
    }
    assert props["name"] == schema["properties"]["name"]
    assert out["additionalProperties"] == {"type": "number", **CAP, "multipleOf": STEP}
    assert grammar_of({"type": "json_schema", "json_schema": {"schema": schema}})


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number", "multipleOf": 0.5, **CAP},  # the user's own step
        {"type": "number", "enum": [0.123456789012345, 1e20]},
        {"type": "number", "const": 1e20},
        {"type": "integer", "minimum": 10**20},  # a cap below it would allow nothing
        {"type": "integer", "maximum": -(10**20)},
        {"type": "number", "minimum": "0"},  # not a number: llguidance's to refuse
        {"type": "string"},
        {"not": {"type": "number"}},  # not walked: narrowing under `not` would widen
        True,
    ],
)
def test_what_is_left_alone(schema: Any) -> None:
    assert bounded_numbers(schema) == schema


def test_a_bound_past_the_cap_leaves_the_other_side_open_and_a_thin_range_keeps_its_digits() -> (
    None
):
    assert bounded_numbers({"type": "number", "minimum": 1e20}) == {
        "type": "number",
        "minimum": 1e20,
        "multipleOf": STEP,
    }
    thin = {"type": "number", "exclusiveMinimum": 0.5, "exclusiveMaximum": 0.50000000001}
    assert bounded_numbers(thin) == thin  # no multiple of the step lies inside
    one = {"type": "number", "minimum": 0.5, "maximum": 0.5}
    assert bounded_numbers(one)["multipleOf"] == STEP  # 0.5 itself is one
    # Draft 4: a boolean exclusiveMaximum makes maximum exclusive.
    draft4 = {"type": "number", "minimum": 0, "maximum": 0.5, "exclusiveMaximum": True}
    assert bounded_numbers(draft4)["multipleOf"] == STEP


def json_schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def test_bounds_are_added_at_any_depth_without_recursion() -> None:
    schema: dict[str, Any] = {"type": "number"}
    for _ in range(5000):  # items in items: each walk of it would recurse 5,000 deep
        schema = {"type": "array", "items": schema}
    out = bounded_numbers(schema)
    for _ in range(5000):
        out = out["items"]
    assert out == {"type": "number", **CAP, "multipleOf": STEP}


@pytest.mark.parametrize("levels", [62, 300, 900, 50_000])
def test_a_response_format_nested_too_deep_is_refused_naming_the_limit(levels: int) -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    with pytest.raises(BadGenerationParams, match="MAX_JSON_DEPTH=64") as info:
        grammar_of(json_schema(schema))
    assert str(info.value).startswith("response_format nests lists and objects deeper")


def test_a_response_format_at_the_limit_is_taken() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(61):  # 64 levels with response_format, json_schema and the innermost
        schema = {"type": "array", "items": schema}
    assert grammar_of(json_schema(schema))


@pytest.mark.parametrize("number", [math.inf, -math.inf, math.nan])
def test_a_schema_holding_a_number_that_is_not_finite_is_refused(number: float) -> None:
    """JSON has no such number: the schema could not travel to a worker."""
    for schema in (
        {"type": "number", "default": number},
        {"type": "array", "items": {"enum": [1, number]}},
        {"type": "number", "maximum": number},
    ):
        with pytest.raises(BadGenerationParams, match="response_format holds the number"):
            grammar_of(json_schema(schema))


def grammars() -> Grammars:
    return Grammars(char_tokenizer(), 97)


def fed(grammars: Grammars, schema: dict[str, Any], text: str) -> Sequence_:
    grammar = grammar_of({"type": "json_schema", "json_schema": {"schema": schema}})
    seq = Sequence_([5], GenerationParams(grammar=grammar), 0.0, print)
    for token in grammars.tokenizer.encode(text):
        grammars.accept(seq, token)
    return seq


def allowed(grammars: Grammars, seq: Sequence_) -> set[str]:
    masked = grammars.mask([seq], torch.zeros(1, 97), [0])[0][0]
    return {grammars.tokenizer.decode([t]) for t in (masked > float("-inf")).nonzero().flatten()}


def test_the_grammar_closes_a_number_after_its_last_fraction_digit_and_caps_integers() -> None:
    g = grammars()
    schema = {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}}}
    seq = fed(g, schema, '{"p": 1.' + "0" * (MAX_FRACTION_DIGITS - 1))
    assert "0" in allowed(g, seq)
    g.accept(seq, g.tokenizer.encode("0")[0])
    assert "0" not in allowed(g, seq)  # the 11th fraction digit: the number must end
    assert "}" in allowed(g, seq)
    integer = {"type": "object", "properties": {"n": {"type": "integer"}}}
    top = fed(g, integer, '{"n": ' + str(MAX_SAFE_INTEGER))
    assert allowed(g, top) & set("0123456789") == set()
    with pytest.raises(BadGenerationParams, match="response_format.*fails parse"):
        fed(g, integer, '{"n": ' + str(MAX_SAFE_INTEGER + 1))


def test_every_walk_through_the_grammar_validates_against_the_schema_as_given() -> None:
    """Random picks among the tokens each mask allows, to the end of the JSON: valid, and
    every number within the cap and the fraction digits."""
    jsonschema = pytest.importorskip("jsonschema")
    g = grammars()
    schema = {
        "type": "object",
        "properties": {
            "p": {"type": "number", "minimum": -1, "exclusiveMaximum": 1},
            "n": {"type": "integer", "minimum": 3},
            "xs": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
        },
        "required": ["p", "n", "xs"],
        "additionalProperties": False,
    }
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        seq = fed(g, schema, "")
        for _step in range(400):
            logits = torch.randn(1, 97, generator=generator)
            token = int(g.mask([seq], logits, [0])[0].argmax())
            seq.generated.append(token)
            if g.accept(seq, token):
                break
        else:
            pytest.fail(f"no end after 400 tokens: {g.tokenizer.decode(seq.generated)!r}")
        text = g.tokenizer.decode(seq.generated)
        jsonschema.validate(json.loads(text), schema)
        for whole, fraction in re.findall(r"(\d+)(?:\.(\d+))?", text):  # no strings here
            assert int(whole) <= MAX_SAFE_INTEGER, text
            assert len(fraction) <= MAX_FRACTION_DIGITS, text
