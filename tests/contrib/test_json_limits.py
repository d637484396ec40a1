"""JSON that Python reads but batchline must not take, on every route family over HTTP:
bodies nested deeper than ``MAX_JSON_DEPTH`` and numbers that are not finite (``NaN``,
``Infinity``, ``1e999``: not JSON, or out of a float's range, yet accepted by Python's
parser). Each is a 4xx in its route family's shape, naming the limit or the parameter, with
one line in the log; never a 500, a traceback or a dropped connection.

The app runs under uvicorn (test_fastapi's ``serve``) with no worker: nothing refused here
may reach a queue (a request let through would wait for its 2 s timeout: a 504).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, field_validator

from batchline import _json_depth
from batchline.codec import MAX_JSON_DEPTH
from batchline.contrib._plumbing._body_thread import LARGE_BODY_BYTES, BodyRoute

from .openai.test_openai import MakeApp, assert_error, gen_queue, make_app
from .test_fastapi import Serve, serve

__all__ = ["gen_queue", "make_app", "serve"]  # fixtures, used here

JSON = {"Content-Type": "application/json"}
LIMIT = f"MAX_JSON_DEPTH={MAX_JSON_DEPTH}"


def nested(depth: int) -> str:
    """JSON text of ``depth`` lists inside each other."""
    return "[" * depth + "]" * depth


def routes(queue: str, gen_queue: str) -> dict[str, tuple[str, str]]:
    """Per route family, its routes: path -> a body template whose ``{x}`` takes any JSON."""
    return {
        "openai": (
            f'{{"model": "{gen_queue}", "prompt": "x", "stop": {{x}}}}',
            "/v1/completions /v1/chat/completions /v1/embeddings /v1/rerank /rerank "
            "/tokenize /detokenize /v1/batches",
        ),
        "tgi": (
            '{"inputs": "x", "parameters": {"stop": {x}}}',
            f"/generate /generate_stream /models/{gen_queue} / /embed",
        ),
        "native": ('{"text": {x}}', "/jobs"),
    }


@pytest.fixture
def http(make_app: MakeApp, serve: Serve, queue: str) -> httpx.Client:  # noqa: F811
    return serve(make_app(timeout_s=2, rerank_queue=f"{queue}-rerank"))


def test_a_body_nested_too_deep_is_a_4xx_of_its_family_naming_the_limit(
    http: httpx.Client,
    queue: str,
    gen_queue: str,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    refused = 0
    for family, (template, paths) in routes(queue, gen_queue).items():
        for path, depth in itertools.product(paths.split(), [MAX_JSON_DEPTH + 1, 900, 50_000]):
            body = template.replace("{x}", nested(depth))
            with caplog.at_level(logging.INFO):
                response = http.post(path, content=body, headers=JSON)
            refused += 1
            if family == "openai":
                error = assert_error(response, 400, code="json_too_deep", param=None)
                assert LIMIT in error["message"], (path, error)
            else:  # TGI's error and error_type, FastAPI's detail
                assert response.status_code == 422, (path, response.text)
                answer = response.json()
                assert answer["error_type"] == "validation", (path, answer)
                assert LIMIT in answer["error"] == answer["detail"], (path, answer)
    lines = [r for r in caplog.records if r.name == "batchline.contrib._plumbing._body_depth"]
    assert len(lines) == refused, [r.getMessage() for r in lines]
    assert all(r.levelno == logging.WARNING and LIMIT in r.getMessage() for r in lines)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]

    # 64 levels in all pass the depth check: each route then answers its own 4xx (a stop
    # that is not a text, and so on), none naming the limit.
    for template, paths in routes(queue, gen_queue).values():
        inner = MAX_JSON_DEPTH - template.split("{x}")[0].count("{")
        for path in paths.split():
            response = http.post(path, content=template.replace("{x}", nested(inner)), headers=JSON)
            assert response.status_code in (400, 404, 422), (path, response.text)
            assert LIMIT not in response.text, path


@pytest.mark.parametrize("enc", ["utf-16-le", "utf-32"])
def test_a_body_in_utf16_or_utf32_is_checked_as_the_text_it_holds(
    http: httpx.Client, queue: str, enc: str
) -> None:
    """JSON bytes in UTF-16 or UTF-32 are parsed (as Python's json takes them): their depth
    is the text's, not that of their bytes read as UTF-8 (U+225B holds a quote's byte)."""
    inner = "[" * 50_000 + "]" * 50_000
    text = '{"model": "%s", "input": ["\u225b", %s, "x"]}' % (queue, inner)  # noqa: UP031
    error = assert_error(
        http.post("/v1/embeddings", content=text.encode(enc), headers=JSON),
        400,
        code="json_too_deep",
        param=None,
    )
    assert LIMIT in error["message"]
    native = http.post("/embed", content=text.encode(enc), headers=JSON)
    assert native.status_code == 422, native.text
    assert LIMIT in native.json()["detail"]


NON_FINITE = ["Infinity", "-Infinity", "NaN", "1e999"]


def test_numbers_that_are_not_finite_are_a_4xx_on_every_family(
    http: httpx.Client,
    queue: str,
    gen_queue: str,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO):
        for number in NON_FINITE:
            tgi_parameters(http, gen_queue, number)
            other_families(http, queue, gen_queue, number)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def tgi_parameters(
    http: httpx.Client,
    gen_queue: str,  # noqa: F811
    number: str,
) -> None:
    """TGI's parameters: a 422 in TGI's shape naming the parameter (not the 500 of a value
    that cannot travel)."""
    paths = ("/generate", "/generate_stream", f"/models/{gen_queue}", "/")
    for path, name in itertools.product(paths, ("temperature", "top_p", "repetition_penalty")):
        body = f'{{"inputs": "x", "parameters": {{"{name}": {number}}}}}'
        response = http.post(path, content=body, headers=JSON)
        assert response.status_code == 422, (path, name, response.text)
        answer = response.json()
        assert set(answer) == {"error", "error_type"}, answer
        assert answer["error_type"] == "validation"
        assert answer["error"].startswith(f"parameters.{name}:"), answer
        assert not re.search(r"\b(inf|nan)\b", answer["error"]), answer  # not Python's


def other_families(
    http: httpx.Client,
    queue: str,
    gen_queue: str,  # noqa: F811
    number: str,
) -> None:
    """The native routes, OpenAI's (a schema holding such a number anywhere included)."""
    # The native routes: FastAPI's 422, the input shown as text (JSON has no such number).
    for path in ("/embed", "/jobs"):
        response = http.post(
            path, content=f'{{"text": "x", "deadline_ms": {number}}}', headers=JSON
        )
        assert response.status_code == 422, (path, response.text)
        [error] = response.json()["detail"]
        assert error["loc"] == ["body", "deadline_ms"], error
    # OpenAI's: sampling parameters, and a schema holding such a number anywhere.
    chat = f'"model": "{gen_queue}", "messages": [{{"role": "user", "content": "x"}}]'
    for extra, param in [
        (f'"temperature": {number}', "temperature"),
        (f'"top_p": {number}', "top_p"),
        (
            '"response_format": {"type": "json_schema", "json_schema": {"name": "n", '
            f'"schema": {{"type": "number", "default": {number}}}}}}}',
            "response_format",
        ),
    ]:
        response = http.post("/v1/chat/completions", content=f"{{{chat}, {extra}}}", headers=JSON)
        assert_error(response, 400, param=param)
    rerank = f'{{"model": "{queue}-rerank", "query": "q", "documents": ["a"], "top_n": {number}}}'
    assert_error(http.post("/v1/rerank", content=rerank, headers=JSON), 400, param="top_n")


def test_a_large_body_is_checked_and_parsed_off_the_event_loop(
    http: httpx.Client,
    gen_queue: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A body over LARGE_BODY_BYTES has its depth scanned and its JSON parsed in the body
    thread, whatever reads it (a route's model, TGI's routes, Cohere's); a small one's on
    the event loop (handing it over would cost more than its parse)."""
    seen: list[tuple[str, int, bool]] = []  # what, its size, on an event loop's thread

    def spy(what: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def spied(data: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(data, bytes | str) and len(data) > 1000:
                seen.append((what, len(data), asyncio._get_running_loop() is not None))
            return fn(data, *args, **kwargs)

        return spied

    monkeypatch.setattr(json, "loads", spy("parse", json.loads))
    monkeypatch.setattr(_json_depth, "text_depth", spy("depth", _json_depth.text_depth))
    validate_json = BaseModel.model_validate_json.__func__  # type: ignore[attr-defined]
    spied_json = spy("parse", lambda data, cls, **kw: validate_json(cls, data, **kw))
    monkeypatch.setattr(
        BaseModel,
        "model_validate_json",
        classmethod(lambda cls, data, **kw: spied_json(data, cls, **kw)),
    )
    bodies = {
        "/v1/chat/completions": {
            "model": "unknown",
            "messages": [{"role": "user", "content": "x"}],
        },
        "/v1/embeddings": {"model": "unknown", "input": "x"},
        "/generate": {"inputs": "x", "parameters": {"unknown": 1}},
        "/rerank": {"model": "unknown", "query": "x", "documents": ["x"]},
    }
    for path, body in bodies.items():
        for padding, large in ((1000, False), (LARGE_BODY_BYTES, True)):
            seen.clear()  # (brackets in a text: the depth is scanned, and is 2 or 3)
            content = json.dumps({**body, "user": "[]" * padding}).encode()
            response = http.post(path, content=content, headers=JSON)
            assert 400 <= response.status_code < 500, (path, response.text)
            mine = [(what, on_loop) for what, size, on_loop in seen if size == len(content)]
            assert {what for what, _ in mine} == {"parse", "depth"}, (path, seen)
            assert all(on_loop is not large for _, on_loop in mine), (path, large, mine)


on_loop: list[bool] = []  # where each Texts was validated (on an event loop's thread)


class Texts(BaseModel):
    texts: list[str]

    @field_validator("texts")
    @classmethod
    def where(cls, texts: list[str]) -> list[str]:
        on_loop.append(asyncio._get_running_loop() is not None)
        return texts


async def count(body: Texts) -> dict[str, int]:
    return {"texts": len(body.texts)}


def test_a_large_body_is_validated_as_its_routes_model_off_the_event_loop() -> None:
    """The route's model validates a large body in the body thread, and the route takes
    its instance; a small body, and a large one that fails (its errors FastAPI's own), are
    validated on the event loop. The route's OpenAPI schema is FastAPI's."""
    app = FastAPI()
    app.router.route_class = BodyRoute
    app.add_api_route("/count", count, methods=["POST"])
    with TestClient(app) as client:
        for n, large in ((10, False), (LARGE_BODY_BYTES // 4, True)):
            on_loop.clear()
            response = client.post("/count", json={"texts": ["abc"] * n})
            assert response.json() == {"texts": n}
            assert on_loop == [not large]
        on_loop.clear()
        response = client.post("/count", json={"texts": ["abc"] * LARGE_BODY_BYTES + [1]})
        assert response.status_code == 422
        assert response.json()["detail"][0]["loc"] == ["body", "texts", LARGE_BODY_BYTES]
        schema = client.get("/openapi.json").json()
    body_schema = schema["paths"]["/count"]["post"]["requestBody"]["content"]["application/json"]
    assert body_schema["schema"] == {"$ref": "#/components/schemas/Texts"}
