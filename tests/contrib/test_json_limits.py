"""JSON that Python reads but batchline must not take, on every route family over HTTP:
bodies nested deeper than ``MAX_JSON_DEPTH`` and numbers that are not finite (``NaN``,
``Infinity``, ``1e999``: not JSON, or out of a float's range, yet accepted by Python's
parser). Each is a 4xx in its route family's shape, naming the limit or the parameter, with
one line in the log; never a 500, a traceback or a dropped connection.

The app runs under uvicorn (test_fastapi's ``serve``) with no worker: nothing refused here
may reach a queue (a request let through would wait for its 2 s timeout: a 504).
"""

from __future__ import annotations

import itertools
import logging
import re

import httpx
import pytest

from batchline.codec import MAX_JSON_DEPTH

from .test_fastapi import Serve, serve
from .test_openai import MakeApp, assert_error, gen_queue, make_app

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
    lines = [r for r in caplog.records if r.name == "batchline.contrib._body_depth"]
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
