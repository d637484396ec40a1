"""Structured output always parses: as a sequence's tokens run out, the closing of its JSON
is forced (strings, arrays, objects, and the required properties not written yet), and it
ends as ``length``. A tiny random model writes what it likes within the grammar, so every
answer that parses at a low token limit is the closing's work."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batchline._llguidance import shortest_closing
from batchline._response_format import grammar_of
from batchline.errors import BadGenerationParams
from batchline.generation import Engine, GenerationParams, SyncGenerator
from batchline.generation._grammar import Grammars
from batchline.generation._types import Sequence_

from tests.generation.test_grammar import drive
from tests.support.models_for_tests import char_tokenizer, tiny_llama_chars
from tests.support.schemas import DEFS_SCHEMAS, json_schema, strict
from tests.support.tiny import alone, tiny_model, torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

TEXT: dict[str, Any] = {"type": "string"}  # no maxLength: only the token limit ends it


SCHEMAS: list[dict[str, Any]] = [
    strict(s=TEXT),
    strict(s=TEXT, n={"type": "integer"}, t={"type": "array", "items": TEXT}),
    strict(a={"type": "array", "items": {"type": "array", "items": {"type": "number"}}}),
    strict(k=strict(x=TEXT, y=TEXT), z={"type": "boolean"}),
    {"type": "object"},  # json_object's: any keys, any values
    {"type": "array", "items": strict(v=TEXT), "minItems": 1},
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return char_tokenizer()


@pytest.fixture(scope="module")
def grammars(tokenizer: Any) -> Grammars:
    return Grammars(tokenizer, 97)


def closed(grammars: Grammars, schema: dict[str, Any], prefix: str) -> str:
    """``prefix`` (what a model wrote) and the closing the search finds after it."""
    grammar = grammar_of(json_schema(schema))
    seq = Sequence_([5], GenerationParams(grammar=grammar), 0.0, print)
    for token in grammars.tokenizer.encode(prefix):
        grammars.accept(seq, token)
    path = shortest_closing(
        grammars.matcher(seq), grammars.alphabet(), 200, written=prefix.encode()
    )
    assert path is not None, prefix
    return prefix + grammars.tokenizer.decode(path)


@pytest.mark.parametrize(
    ("schema", "prefix", "want"),
    [
        (strict(s=TEXT), '{"s": "ab', '{"s": "ab"}'),
        (strict(s=TEXT), '{"s": "a\\', '{"s": "a\\""}'),  # inside an escape
        (strict(s=TEXT), '{"s": "a\\u00', None),  # inside a \u escape: 2 more hex digits
        (strict(n={"type": "number"}), '{"n": 12.', '{"n": 12.0}'),  # inside a number
        (strict(n={"type": "number"}), '{"n": -', '{"n": -1}'),  # (no -0 in its grammar)
        (strict(n={"type": "number"}), '{"n": 1', '{"n": 1}'),
        (strict(a=SCHEMAS[2]["properties"]["a"]), '{"a": [[1, 2], [', '{"a": [[1, 2], []]}'),
        (SCHEMAS[1], '{"s": "x', '{"s": "x", "n": 0, "t": []}'),  # required, not written yet
        (SCHEMAS[3], '{"k": {"x": "', '{"k": {"x": "", "y": ""}, "z": false}'),
        ({"type": "object"}, '{"ke', None),  # a key of any name, and a value after it
        (strict(b={"type": "boolean"}), '{"b": t', '{"b": true}'),
        (strict(e={"enum": ["alpha", "beta"]}), '{"e": "al', '{"e": "alpha"}'),
        (strict(p={"type": "string", "pattern": "^[a-z]+@[a-z]+$"}), '{"p": "a', None),
        (SCHEMAS[5], "[", '[{"v": ""}]'),
    ],
)
def test_the_closing_is_valid_json_for_the_schema_and_the_shortest_found(
    grammars: Grammars, schema: dict[str, Any], prefix: str, want: str | None
) -> None:
    text = closed(grammars, schema, prefix)
    jsonschema.validate(json.loads(text), schema)
    if want is not None:
        assert text == want


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_every_answer_parses_when_its_tokens_run_out(tokenizer: Any, dtype: str) -> None:
    """Each schema at token limits from the shortest value's length up, greedy and seeded,
    beside rows without a grammar: every answer parses and validates, those cut by their
    limit end as ``length``, and the rows without a grammar are what they are alone."""
    model = tiny_model("llama", getattr(torch, dtype))
    engine = Engine(model, tokenizer)
    free = [
        Sequence_([5, 6, 7], GenerationParams(max_new_tokens=30), 0.0, print),
        Sequence_([9, 10], GenerationParams(max_new_tokens=25), 0.0, print),
    ]
    bound: list[tuple[Sequence_, dict[str, Any]]] = []
    for i, schema in enumerate(SCHEMAS):
        grammar = grammar_of(json_schema(schema))
        shortest = engine.grammars.compile(grammar or "").shortest
        assert shortest is not None
        for extra in (0, 2, 9):
            for sampling in ({}, {"temperature": 1.0, "seed": 10 * i + extra}):
                params = GenerationParams(
                    max_new_tokens=len(shortest) + extra, grammar=grammar, **sampling
                )
                checked = engine.check([5 + i, 6], params)
                bound.append((Sequence_([5 + i, 6], checked, 0.0, print), schema))
    reasons = drive(engine, [free[0], *(s for s, _ in bound), free[1]])
    cut = 0
    for seq, schema in bound:
        jsonschema.validate(json.loads(seq.text), schema)
        assert reasons[id(seq)] in ("stop", "length"), seq.text
        assert len(seq.generated) <= seq.params.max_new_tokens
        cut += reasons[id(seq)] == "length"
    assert cut >= len(bound) // 2  # most were cut by their limit, and closed
    assert engine.picker.closer.searches > 0
    alone_model = tiny_model("llama", getattr(torch, dtype))
    assert free[0].generated == alone(alone_model, [5, 6, 7], 30)
    assert free[1].generated == alone(alone_model, [9, 10], 25)


def test_a_sampled_row_closes_as_it_would_alone(tokenizer: Any) -> None:
    """The closing is each sequence's own: a seeded row closed beside others writes what
    it writes alone."""
    model = tiny_model("llama")
    grammar = grammar_of(json_schema(SCHEMAS[1]))

    def seq(seed: int) -> Sequence_:
        params = GenerationParams(max_new_tokens=30, grammar=grammar, temperature=1.0, seed=seed)
        return Sequence_([5, 6], params, 0.0, print)

    together = [seq(s) for s in range(2)]
    drive(Engine(model, tokenizer), together)
    for s, row in enumerate(together):
        lone = seq(s)
        drive(Engine(model, tokenizer), [lone])
        assert lone.generated == row.generated
        jsonschema.validate(json.loads(row.text), SCHEMAS[1])


def test_a_token_limit_below_the_shortest_value_is_refused(tokenizer: Any) -> None:
    """No answer at all rather than one that cannot parse: the shortest value of
    ``{"s": "", "n": 0, "t": []}`` takes 26 tokens of this tokenizer (one a character)."""
    model = tiny_model("llama")
    fmt = json_schema(SCHEMAS[1])
    with SyncGenerator(model, tokenizer=tokenizer) as gen:
        with pytest.raises(BadGenerationParams, match="fewer than the 26 tokens") as refused:
            gen.generate(prompt_ids=[5, 6], max_new_tokens=25, response_format=fmt)
        assert "max_new_tokens 25" in str(refused.value)
        exact = gen.generate(prompt_ids=[5, 6], max_new_tokens=26, response_format=fmt)
    assert exact.text == '{"s": "", "n": 0, "t": []}'
    assert exact.finish_reason == "length"


def test_a_token_that_commits_to_more_than_is_left_is_taken_back() -> None:
    """Greedy, the tiny model follows a recursive list through its ``$ref`` (each ``, ``
    commits to one more node, whose required ``"v"`` the closing must then write): the
    comma that would leave too little is taken back, and the list closed before it."""
    model, tokenizer = tiny_llama_chars()
    schema = DEFS_SCHEMAS["recursive"]
    with SyncGenerator(model, tokenizer=tokenizer) as gen:
        result = gen.generate(
            messages=[{"role": "user", "content": "A city as JSON."}],
            max_new_tokens=60,
            response_format=json_schema(schema),
        )
    assert result.finish_reason == "length"
    assert result.text.count('"next": {"v": ') >= 2
    jsonschema.validate(json.loads(result.text), schema)
