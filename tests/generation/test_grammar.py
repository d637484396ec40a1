"""Structured output: response_format read and checked, grammars compiled once per schema
against the tokenizer, and constrained decoding under continuous batching. The tiny model's
weights are random, so every constrained output that parses and validates is the mask's
work alone."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batchline._response_format import grammar_of
from batchline.errors import BadGenerationParams
from batchline.generation import Engine, GenerationParams, SyncGenerator
from batchline.generation._grammar import Grammars
from batchline.generation._request import parse_request
from batchline.generation._types import Sequence_

from tests.support.models_for_tests import char_tokenizer
from tests.support.tiny import EOS, alone, tiny_model, torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "count", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b", "c"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "inner": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}},
                "required": ["n"],
                "additionalProperties": False,
            },
        },
        "required": ["tags", "inner"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}},
        "required": ["name"],
        "additionalProperties": False,
    },
]


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return char_tokenizer()


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("llama")


def test_response_format_is_read_and_refused_naming_it() -> None:
    assert grammar_of(None) is None
    assert grammar_of({"type": "text"}) is None
    assert "json_schema" in (grammar_of({"type": "json_object"}) or "")
    assert json.loads(grammar_of(json_schema(SCHEMAS[0])) or "")
    for bad, why in [
        ({"type": "xml"}, "type must be one of"),
        ("json", "must be an object"),
        ({"type": "json_object", "schema": {}}, "unknown key(s) schema"),
        ({"type": "json_schema"}, "json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema must be an object"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}, "unknown key(s) x"),
        (json_schema({"type": "nope"}), "Invalid type: nope"),
        (json_schema({"$ref": "#/missing"}), "missing"),
    ]:
        with pytest.raises(BadGenerationParams, match="response_format") as info:
            grammar_of(bad)
        assert why in str(info.value)


def test_parse_request_carries_the_grammar_in_its_params() -> None:
    parsed = parse_request({"prompt": "x", "response_format": {"type": "json_object"}})
    assert parsed.params.grammar is not None
    assert parse_request({"prompt": "x"}).params.grammar is None
    with pytest.raises(BadGenerationParams, match="response_format"):
        parse_request({"prompt": "x", "response_format": {"type": "yaml"}})


def test_a_grammar_compiles_once_per_text_and_each_sequence_gets_its_own_matcher(
    tokenizer: Any,
) -> None:
    grammars = Grammars(tokenizer, 97)
    grammar = grammar_of(json_schema(SCHEMAS[0]))
    assert grammar is not None
    a = Sequence_([5], GenerationParams(grammar=grammar), 0.0, print)
    b = Sequence_([5], GenerationParams(grammar=grammar), 0.0, print)
    logits = torch.zeros(2, 97)
    masked, failed = grammars.mask([a, b], logits, [0, 1])
    assert not failed
    assert grammars.compiles == 1
    assert a.matcher is not b.matcher
    allowed = (masked[0] > float("-inf")).nonzero().flatten().tolist()
    assert [tokenizer.decode([t]) for t in allowed] == ["{"]
    for token in tokenizer.encode('{"color": "red", "count": 7, "ok": true'):
        assert not grammars.accept(a, token)
    assert grammars.accept(a, tokenizer.encode("}")[0])  # complete: the sequence ends
    assert not grammars.accept(Sequence_([5], GenerationParams(), 0.0, print), 9)
    assert grammars.compiles == 1
    free = Sequence_([5], GenerationParams(), 0.0, print)
    only = logits[:1]
    assert grammars.mask([free], only, [])[0] is only
    unmasked, _ = grammars.mask([free, b], logits, [1])
    assert torch.equal(unmasked[0], logits[0])  # a row without a grammar is untouched


def drive(engine: Engine, seqs: list[Sequence_]) -> dict[int, str]:
    """Run ``seqs`` (joining at once) to their ends; each one's finish reason."""
    reasons: dict[int, str] = {}
    out = engine.step(seqs)
    while True:
        reasons.update({id(s): r for s, r in out.finished})
        assert not out.failed, out.failed
        if not engine.running:
            return reasons
        out = engine.step([])


def test_random_model_constrained_output_validates_beside_unconstrained_rows(
    model: Any, tokenizer: Any
) -> None:
    engine = Engine(model, tokenizer)
    free = [
        Sequence_([5, 6, 7], GenerationParams(max_new_tokens=12), 0.0, print),
        Sequence_([9, 10], GenerationParams(max_new_tokens=9), 0.0, print),
    ]
    bound = [
        Sequence_(
            [5 + i, 6, 7],
            GenerationParams(
                max_new_tokens=80,
                grammar=engine.check(
                    [5],
                    parse_request({"prompt": "x", "response_format": json_schema(schema)}).params,
                ).grammar,
                **sampling,
            ),
            0.0,
            print,
        )
        for i, schema in enumerate(SCHEMAS)
        for sampling in ({}, {"temperature": 1.0, "seed": i})
    ]
    reasons = drive(engine, [free[0], bound[0], free[1], *bound[1:]])
    assert free[0].generated == alone(model, [5, 6, 7], 12)
    assert free[1].generated == alone(model, [9, 10], 9)
    for seq, schema in zip(bound, [s for s in SCHEMAS for _ in range(2)], strict=True):
        assert reasons[id(seq)] == "stop", seq.text
        assert EOS not in seq.generated
        jsonschema.validate(json.loads(seq.text), schema)
    assert engine.grammars.compiles == len(SCHEMAS)


def test_a_constrained_answer_cut_by_its_token_limit_ends_with_length(
    model: Any, tokenizer: Any
) -> None:
    """The JSON is not complete (it does not parse): the reason says it was cut, as OpenAI's
    ``length`` does."""
    engine = Engine(model, tokenizer)
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    grammar = grammar_of(json_schema(schema))
    seq = Sequence_([5, 6], GenerationParams(max_new_tokens=8, grammar=grammar), 0.0, print)
    assert drive(engine, [seq]) == {id(seq): "length"}
    assert len(seq.generated) == 8
    assert seq.text.startswith('{"s": "')


def test_a_schema_that_does_not_compile_is_refused_at_check(model: Any) -> None:
    engine = Engine(model)  # no tokenizer: nothing to compile against
    params = GenerationParams(grammar=grammar_of({"type": "json_object"}))
    with pytest.raises(BadGenerationParams, match="response_format"):
        engine.check([5], params)


def test_in_process_generator_takes_response_format_per_call(model: Any, tokenizer: Any) -> None:
    schema = SCHEMAS[1]
    with SyncGenerator(model, tokenizer=tokenizer) as gen:
        plain = gen.generate(prompt_ids=[5, 6], max_new_tokens=6)
        result = gen.generate(
            prompt_ids=[5, 6], max_new_tokens=80, response_format=json_schema(schema)
        )
        with pytest.raises(BadGenerationParams, match="response_format"):
            gen.generate(prompt_ids=[5, 6], response_format=json_schema({"type": "nope"}))
    assert list(plain.token_ids) == alone(model, [5, 6], 6)
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), schema)
