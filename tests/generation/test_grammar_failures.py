"""One request's grammar fails that request alone, with a clear BadGenerationParams, at
compile time (its probe) or in any step (its mask, its token), and every other sequence's
tokens are what they would have been without it. A grammar that failed is refused from then
on; a matcher in an error state never lets a token through silently."""

from __future__ import annotations

from typing import Any

import pytest

from batchline._llguidance import limits
from batchline._response_format import check_response_format, grammar_of
from batchline.errors import BadGenerationParams
from batchline.generation import Engine, GenerationParams, SyncGenerator
from batchline.generation._grammar import Grammars
from batchline.generation._types import Sequence_

from tests.generation.test_grammar import model, tokenizer
from tests.support.schemas import GOOD, HUGE_PATTERN, LAZY, json_schema
from tests.support.tiny import alone, torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

__all__ = ["model", "tokenizer"]  # fixtures, used here


def grammar(schema: dict[str, Any]) -> str:
    found = grammar_of(json_schema(schema))
    assert found is not None
    return found


def innocents() -> list[Sequence_]:
    """Greedy and seeded rows, with and without a grammar."""
    return [
        Sequence_([5, 6, 7], GenerationParams(max_new_tokens=12), 0.0, print),
        Sequence_(
            [9, 10], GenerationParams(max_new_tokens=10, temperature=1.0, seed=3), 0.0, print
        ),
        Sequence_([5, 8], GenerationParams(max_new_tokens=40, grammar=grammar(GOOD)), 0.0, print),
        Sequence_(
            [7, 7],
            GenerationParams(max_new_tokens=40, grammar=grammar(GOOD), temperature=1.0, seed=5),
            0.0,
            print,
        ),
    ]


def drive(engine: Engine, joining: list[Sequence_]) -> list[tuple[Sequence_, Exception]]:
    """Run ``joining`` to their ends; the failures."""
    failed: list[tuple[Sequence_, Exception]] = []
    out = engine.step(joining)
    while True:
        failed += out.failed
        if not engine.running:
            return failed
        out = engine.step([])


def test_a_grammar_that_fails_as_it_decodes_fails_its_request_alone(
    model: Any, tokenizer: Any
) -> None:
    without = innocents()
    assert drive(Engine(model, tokenizer), without) == []

    engine = Engine(model, tokenizer)
    bad = Sequence_([5, 6], GenerationParams(max_new_tokens=20, grammar=grammar(LAZY)), 0.0, print)
    beside = innocents()
    failed = drive(engine, [beside[0], beside[1], bad, beside[2], beside[3]])
    assert [seq for seq, _ in failed] == [bad]
    error = failed[0][1]
    assert isinstance(error, BadGenerationParams)
    assert "response_format failed as it was decoded" in str(error)
    assert "too many expressions" in str(error)
    for alone_row, row in zip(without, beside, strict=True):
        assert row.generated == alone_row.generated, row.params
    assert beside[0].generated == alone(model, [5, 6, 7], 12)

    # The same grammar again: refused before it runs, with the same error...
    with pytest.raises(BadGenerationParams, match="failed as it was decoded"):
        engine.check([5], GenerationParams(grammar=grammar(LAZY)))
    # ...and a sequence that joins without a check fails; it never ends on an end token.
    again = Sequence_(
        [5, 6], GenerationParams(max_new_tokens=20, grammar=grammar(LAZY)), 0.0, print
    )
    assert [seq for seq, _ in drive(engine, [again])] == [again]
    assert again.generated == []


def test_the_generator_raises_bad_generation_params_for_that_request_only(
    model: Any, tokenizer: Any
) -> None:
    with SyncGenerator(model, tokenizer=tokenizer) as gen:
        with pytest.raises(BadGenerationParams, match="response_format failed as it was decoded"):
            gen.generate(prompt_ids=[5, 6], max_new_tokens=20, response_format=json_schema(LAZY))
        fine = gen.generate(prompt_ids=[5, 6, 7], max_new_tokens=12)
    assert list(fine.token_ids) == alone(model, [5, 6, 7], 12)


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        (HUGE_PATTERN, "too many expressions"),  # fails on its first byte after compiling
        ({"$ref": "#"}, "no JSON value satisfies the schema"),  # a self loop
        (
            {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a",
            },
            "no JSON value satisfies the schema",
        ),
        (  # a required property that recurses without end: no finite value
            {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
            "response_format",
        ),
    ],
)
def test_a_schema_that_fails_its_probe_is_refused_before_it_runs(
    model: Any, tokenizer: Any, schema: dict[str, Any], why: str
) -> None:
    """The API's check and the worker's refuse it alike (the same compiler and limits)."""
    with pytest.raises(BadGenerationParams, match="response_format") as api:
        check_response_format(json_schema(schema))
    assert why in str(api.value)
    engine = Engine(model, tokenizer)
    with pytest.raises(BadGenerationParams, match="response_format") as worker:
        engine.check([5], GenerationParams(grammar=grammar(schema)))
    assert why in str(worker.value)
    assert "<" not in str(worker.value)  # no parser state or grammar dump in the message


def test_a_matcher_in_an_error_state_never_lets_a_token_through(tokenizer: Any) -> None:
    """Copies of a compiled grammar share its lexer: once one fails, the next mask of
    another fails too, and is reported (it would otherwise allow only the end token)."""
    grammars = Grammars(tokenizer, 97)
    a, b = (Sequence_([5], GenerationParams(grammar=grammar(LAZY)), 0.0, print) for _ in "ab")
    for token in tokenizer.encode('{"'):  # as the engine does: a mask, then the token
        for seq in (a, b):
            assert not grammars.mask([seq], torch.zeros(1, 97), [0])[1]
            grammars.accept(seq, token)
    grammars.mask([a], torch.zeros(1, 97), [0])
    with pytest.raises(BadGenerationParams, match="too many expressions"):
        grammars.accept(a, tokenizer.encode("z")[0])
    free = Sequence_([5], GenerationParams(), 0.0, print)
    logits = torch.randn(2, 97)
    masked, failed = grammars.mask([free, b], logits, [1])
    assert [row for row, _ in failed] == [1]
    assert isinstance(failed[0][1], BadGenerationParams)
    assert torch.equal(masked, logits)  # nothing masked: the failed row leaves; free is free


class _AllowsNothing:
    """A matcher whose mask allows no token and which reports no error."""

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        return None  # the words stay zero

    def is_error(self) -> bool:
        return False


def test_a_mask_that_allows_no_token_fails_the_row(tokenizer: Any) -> None:
    """Reported, not an argmax over minus infinities (which would pick token 0)."""
    grammars = Grammars(tokenizer, 97)
    seq = Sequence_([5], GenerationParams(grammar=grammar(GOOD)), 0.0, print)
    seq.matcher = _AllowsNothing()
    _, failed = grammars.mask([seq], torch.zeros(1, 97), [0])
    assert [row for row, _ in failed] == [0]
    assert "allows no token" in str(failed[0][1])


def test_the_limits_are_the_same_for_the_check_and_the_compile() -> None:
    """A bound on what a schema compiles into and on the time its lexer takes to build."""
    bounds = limits()
    assert bounds.max_grammar_size == 500_000
    assert bounds.initial_lexer_fuel == 1_000_000
    assert not bounds.verbose_errors
    enums = {f"k{i}": {"enum": [f"v{i}_{j}" for j in range(50)]} for i in range(3000)}
    big = {"type": "object", "properties": enums}
    with pytest.raises(BadGenerationParams, match="too big"):
        grammar_of(json_schema(big))
    with pytest.raises(BadGenerationParams, match="too big"):
        check_response_format(json_schema(big))
