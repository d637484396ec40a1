"""Structured output over the service: the official client's ``response_format`` through
uvicorn, Redis and a real generation worker whose tiny model has random weights (so the
JSON that comes back, valid against its schema, is the mask's work)."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ..test_fastapi import Serve, serve
from .test_openai import MakeApp, client_for, make_app
from tests.support.schemas import (
    DEFS_SCHEMAS,
    HUGE_PATTERN,
    LAZY,
    SEED,
    json_schema,
    json_schema_format,
)
from tests.support.service import WorkerThread, spec

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

__all__ = ["make_app", "serve"]  # fixtures, used here

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "population": {"type": "integer", "minimum": 1, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["city", "population", "tags"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "A city as JSON."}]


@pytest.fixture
def gen_queue(queue: str) -> str:
    return f"{queue}-gen"


@pytest.mark.slow
def test_response_format_through_redis_and_a_worker(
    make_app: MakeApp,  # noqa: F811
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,
) -> None:
    start_worker("generate", model_path=spec("tiny_llama_chars"), queue=gen_queue)
    client = client_for(serve(make_app()))
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    answer = client.chat.completions.create(
        model=gen_queue, messages=CHAT, max_tokens=120, response_format=fmt
    )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), SCHEMA)

    sampled = client.chat.completions.create(
        model=gen_queue,
        messages=CHAT,
        max_tokens=120,
        temperature=1.0,
        seed=3,
        response_format=fmt,
    )
    jsonschema.validate(json.loads(sampled.choices[0].message.content or ""), SCHEMA)

    plain = client.chat.completions.create(model=gen_queue, messages=CHAT, max_tokens=5)
    assert plain.usage is not None
    assert plain.usage.completion_tokens <= 5  # unconstrained, beside

    completion = client.completions.create(
        model=gen_queue, prompt="{", max_tokens=120, extra_body={"response_format": fmt}
    )
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=gen_queue,
            messages=CHAT,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "required": 5}},
            },
        )
    assert refused.value.param == "response_format"
    assert "response_format" in str(refused.value)


@pytest.mark.slow
def test_schemas_with_defs_and_refs_recursive_ones_included(
    make_app: MakeApp,  # noqa: F811
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,
) -> None:
    """``$defs`` and ``$ref`` (keys that start with ``$``) reach the worker as sent: each
    answer is complete and valid, on both routes."""
    start_worker("generate", model_path=spec("tiny_llama_chars"), queue=gen_queue)
    client = client_for(serve(make_app()))
    for name, schema in DEFS_SCHEMAS.items():
        fmt: Any = json_schema_format(name)
        answer = client.chat.completions.create(
            model=gen_queue,
            messages=CHAT,
            max_tokens=200,
            temperature=1.0,
            seed=SEED,
            response_format=fmt,
        )
        assert answer.choices[0].finish_reason == "stop", (name, answer)
        jsonschema.validate(json.loads(answer.choices[0].message.content or ""), schema)
        completion = client.completions.create(
            model=gen_queue,
            prompt="{",
            max_tokens=200,
            temperature=1.0,
            seed=SEED,
            extra_body={"response_format": fmt},
        )
        assert completion.choices[0].finish_reason == "stop", (name, completion)
        jsonschema.validate(json.loads(completion.choices[0].text), schema)
    # Greedy, the list recurses through its $ref until the token limit: the grammar follows it.
    deep = client.chat.completions.create(
        model=gen_queue,
        messages=CHAT,
        max_tokens=60,
        response_format=json_schema_format("recursive"),  # type: ignore[arg-type]
    )
    assert deep.choices[0].finish_reason == "length"
    content = deep.choices[0].message.content or ""
    assert content.count('"next": {"v": ') >= 2  # (the closing took its last one back)
    jsonschema.validate(json.loads(content), DEFS_SCHEMAS["recursive"])  # closed as it ran out


@pytest.mark.slow
def test_a_bad_schema_is_a_400_and_the_requests_beside_it_are_answered(
    make_app: MakeApp,  # noqa: F811
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,
) -> None:
    """One the API's check catches (400 before anything is queued), one that fails only as
    the worker decodes it (400 too: the worker's BadGenerationParams); a streamed chat
    without a response_format beside them ends as it would alone."""
    start_worker("generate", model_path=spec("tiny_llama_chars"), queue=gen_queue)
    client = client_for(serve(make_app()))
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=gen_queue, messages=CHAT, max_tokens=20, response_format=json_schema(HUGE_PATTERN)
        )
    assert refused.value.param == "response_format"
    assert "too many expressions" in str(refused.value)

    def streamed() -> tuple[str, str | None]:
        chunks = list(
            client.chat.completions.create(
                model=gen_queue, messages=CHAT, max_tokens=30, stream=True
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)

    def lazy() -> BaseException | None:
        try:
            client.chat.completions.create(
                model=gen_queue, messages=CHAT, max_tokens=20, response_format=json_schema(LAZY)
            )
        except openai.APIError as exc:
            return exc
        return None

    with ThreadPoolExecutor(3) as pool:
        stream, bad, bad_again = pool.submit(streamed), pool.submit(lazy), pool.submit(lazy)
        (text, reason), errors = stream.result(), [bad.result(), bad_again.result()]
    for error in errors:
        assert isinstance(error, openai.BadRequestError), error
        assert "response_format" in str(error)
    alone = client.chat.completions.create(model=gen_queue, messages=CHAT, max_tokens=30)
    assert (text, reason) == (alone.choices[0].message.content, alone.choices[0].finish_reason)
