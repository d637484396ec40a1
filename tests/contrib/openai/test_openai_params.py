"""Request parameters, end to end: strict types and ranges on ``/v1`` and on ``/embed``.

Every refusal is checked by the parameter it names: on ``/v1``, OpenAI's error object with
``param``; on ``/embed`` and ``/jobs``, FastAPI's 422 with the parameter's ``loc``. The app
runs under uvicorn (test_fastapi's ``serve``); the official ``openai`` client sends what it
can, raw JSON the rest (``NaN``, ``1e999``, wrong types in nested objects). Values at the edges
of the ranges are checked where they arrive: a worker of ``web_models.generation_echo``
answers each generation request with the request itself, and the tiny Llama samples with the
extreme seeds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from ..test_fastapi import Serve, serve
from .test_openai import MakeApp, assert_error, client_for, gen_queue, make_app
from tests.support import web_models
from tests.support.schemas import HUGE_PATTERN, json_schema
from tests.support.service import WorkerThread
from tests.worker.test_generate import CHAT, TINY, in_process, reference

openai = pytest.importorskip("openai")

__all__ = ["gen_queue", "make_app", "reference", "serve"]  # fixtures, used here

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
ECHO = f"{web_models.__name__}:generation_echo"
JSON = {"Content-Type": "application/json"}

#: (what the body sets, the parameter the 400 names) for both generation routes.
GENERATION: list[tuple[dict[str, Any], str]] = [
    *[({"max_tokens": v}, "max_tokens") for v in (0, -1, 2**63, "10", 10.0, True)],
    *[({"temperature": v}, "temperature") for v in (-0.1, 2.01, "1", True, [1])],
    *[({"top_p": v}, "top_p") for v in (0, -0.5, 1.01, "0.5")],
    *[({"top_k": v}, "top_k") for v in (-1, 2**63, "5", 1.5)],
    *[({"seed": v}, "seed") for v in (2**63, 2**64, INT64_MIN - 1, "7", 7.0, True)],
    *[({"stop": v}, "stop") for v in ("", ["s"] * 17, 5)],
    *[({"stop": v}, "stop.[1]") for v in (["s", ""], ["s", 5])],
    *[({"n": v}, "n") for v in (17, 0, -1, "1", 1.0, True)],
    *[({"stream": v}, "stream") for v in ("yes", "true", 1)],
    ({"stream_options": "yes"}, "stream_options"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stream_options": {"other": True}}, "stream_options.other"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"user": 5}, "user"),
    ({"model": 5}, "model"),
    ({"model": ""}, "model"),
    ({"foo": 1}, "foo"),
]
COMPLETION: list[tuple[dict[str, Any], str]] = [
    *[({"prompt": v}, "prompt") for v in (5, ["a", "b"], [], None)],
    ({"prompt": [[1, 2]]}, "prompt.[0]"),  # (token arrays are not taken)
    ({"echo": True}, "echo"),
    ({"suffix": "x"}, "suffix"),
    *[({"best_of": v}, "best_of") for v in (2, "1", 1.0)],
    *[({"logprobs": v}, "logprobs") for v in (21, -1, True, "5", 1.0)],
]
_USER = {"role": "user", "content": "x"}
CHAT_ONLY: list[tuple[dict[str, Any], str]] = [
    *[({"messages": v}, "messages") for v in ([], "hi", None)],
    ({"messages": [{**_USER, "role": "robot"}]}, "messages.[0].role"),
    ({"messages": [_USER, {**_USER, "content": 5}]}, "messages.[1].content"),
    ({"messages": [{"role": "user"}]}, "messages"),  # (a content is needed but beside calls)
    ({"messages": [{**_USER, "name": 5}]}, "messages.[0].name"),
    (
        {"messages": [{**_USER, "content": [{"type": "image", "text": "x"}]}]},
        "messages.[0].content.[0].type",
    ),
    (
        {"messages": [{**_USER, "content": [{"type": "text", "text": 5}]}]},
        "messages.[0].content.[0].text",
    ),
    (
        {"messages": [{**_USER, "content": [{"type": "text", "text": "x", "a": 1}]}]},
        "messages.[0].content.[0].a",
    ),
    ({"messages": [{**_USER, "tool_calls": [{"id": "1"}]}]}, "messages"),
    *[({"max_completion_tokens": v}, "max_completion_tokens") for v in (0, "5", 2**63, 5.0)],
    ({"max_tokens": 6, "max_completion_tokens": 5}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    *[({"logprobs": True, "top_logprobs": v}, "top_logprobs") for v in (21, -1, "2", 2.0)],
    *[({"logprobs": v}, "logprobs") for v in (1, "true", 5)],
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),  # (without tools)
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": 5}, "tool_choice"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "response_format": {"type": "json_object"},
        },
        "tools",
    ),
    *[
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                "tool_choice": "required",
            },
            "tools",
        )
        for schema in (HUGE_PATTERN, {"$ref": "#"}, {"type": "x"})
    ],
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
        "response_format",
    ),
    # Schemas the worker could not compile: the API compiles them as the worker does.
    *[
        ({"response_format": json_schema(schema)}, "response_format")
        for schema in (HUGE_PATTERN, {"$ref": "#"})
    ],
]
EMBEDDINGS: list[tuple[dict[str, Any], str]] = [
    *[({"input": v}, "input") for v in ("", [], ["x"] * 2049, 5, "x" * 20_001)],
    *[({"input": v}, "input.[1]") for v in (["ok", ""], ["ok", 5], ["ok", "x" * 20_001])],
    ({"input": [1, 2]}, "input.[0]"),  # (token arrays are not taken)
    ({"encoding_format": "int8"}, "encoding_format"),
    *[({"dimensions": v}, "dimensions") for v in (0, -1, "8", 8.0, True, 2**63)],
    ({"user": 5}, "user"),
    ({"model": 5}, "model"),
    ({"foo": 1}, "foo"),
]


def test_each_bad_parameter_is_a_400_naming_it(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811 (the fixture imported above)
    queue: str,
    gen_queue: str,  # noqa: F811
) -> None:
    http = serve(make_app(timeout_s=2))  # no worker: a request let through would be a 504
    routes = {
        "/v1/completions": ({"model": gen_queue, "prompt": "x"}, GENERATION + COMPLETION),
        "/v1/chat/completions": ({"model": gen_queue, "messages": CHAT}, GENERATION + CHAT_ONLY),
        "/v1/embeddings": ({"model": queue, "input": "x"}, EMBEDDINGS),
    }
    wrong = []  # every case that is not answered as it should be, to show them all at once
    for path, (base, cases) in routes.items():
        for change, param in cases:
            response = http.post(path, json={**base, **change})
            try:
                error = assert_error(response, 400, param=param, type="invalid_request_error")
                assert error["message"].startswith(f"{param}: "), error
            except AssertionError as exc:
                wrong.append(f"{path} {change}: {exc}")
    assert not wrong, "\n".join(wrong)

    # JSON that Python reads as numbers out of every range (not JSON's own, but accepted by
    # the parser): refused as out of range, not a 500.
    for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
        content = f'{{"model": "{gen_queue}", "prompt": "x", "temperature": {literal}}}'
        response = http.post("/v1/completions", content=content, headers=JSON)
        assert_error(response, 400, param="temperature")
    assert_error(http.post("/v1/completions", content="{", headers=JSON), 400, param=None)


def test_a_schema_is_checked_off_the_event_loop(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    gen_queue: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Compiling a schema takes up to about half a second for a megabyte's: the API has a
    child process do it, never its own event loop (nor a thread beside it)."""
    from batchline import _llguidance

    compiled_here: list[str] = []

    def spy(grammar: str, alphabet: Any) -> Any:
        compiled_here.append(grammar)
        raise AssertionError("a schema was compiled in the API's process")

    monkeypatch.setattr(_llguidance, "compile_grammar", spy)
    http = serve(make_app(timeout_s=2))
    for _ in range(2):  # (the second goes to the same child)
        body = {"model": gen_queue, "messages": CHAT, "response_format": json_schema(HUGE_PATTERN)}
        response = http.post("/v1/chat/completions", json=body)
        error = assert_error(response, 400, param="response_format")
        assert "too many expressions" in error["message"]
    assert compiled_here == []


def test_the_official_client_gets_the_400s_of_strict_parameters(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    queue: str,
    gen_queue: str,  # noqa: F811
) -> None:
    client = client_for(serve(make_app(timeout_s=2)))
    for extra, param in [
        ({"stream": "yes"}, "stream"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"n": "1"}, "n"),
        ({"seed": 2**63}, "seed"),
        ({"seed": INT64_MIN - 1}, "seed"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"extra_body": {"top_k": -1}}, "top_k"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=gen_queue, messages=CHAT, **extra)
        assert refused.value.param == param, (extra, refused.value)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=gen_queue, prompt="x", max_tokens=0)
    assert refused.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=queue, input="x", dimensions=0)
    assert refused.value.param == "dimensions"


@pytest.mark.slow
def test_values_at_the_edges_reach_the_worker_as_sent(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,  # noqa: F811
) -> None:
    start_worker(ECHO, queue=gen_queue)
    client = client_for(serve(make_app()))

    def received(**params: Any) -> dict[str, Any]:
        answer = client.completions.create(model=gen_queue, prompt="x", **params)
        value: dict[str, Any] = json.loads(answer.choices[0].text)
        assert value.pop("prompt") == "x"
        return value

    # A tiny temperature is in range (a worker decodes it greedily): passed on as it is.
    assert received(temperature=1e-300, seed=INT64_MAX) == {
        "temperature": 1e-300,
        "seed": INT64_MAX,
    }
    assert received(temperature=2, top_p=1e-300, seed=INT64_MIN) == {
        "temperature": 2.0,  # an integer is a number
        "top_p": 1e-300,
        "seed": INT64_MIN,
    }
    assert received(temperature=0, top_p=1, max_tokens=INT64_MAX, extra_body={"top_k": 0}) == {
        "temperature": 0.0,
        "top_p": 1.0,
        "max_new_tokens": INT64_MAX,
        "top_k": 0,
    }
    chat = client.chat.completions.create(
        model=gen_queue, messages=CHAT, max_tokens=3, max_completion_tokens=3, n=1, stream=False
    )
    assert json.loads(chat.choices[0].message.content or "")["max_new_tokens"] == 3


@pytest.mark.parametrize("seed", [INT64_MIN, INT64_MAX])
@pytest.mark.slow
def test_the_extreme_seeds_sample_as_in_process(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,  # noqa: F811
    reference: Any,  # noqa: F811
    seed: int,
) -> None:
    start_worker("generate", model_path=TINY, queue=gen_queue)
    client = client_for(serve(make_app()))
    params = {"max_tokens": 8, "temperature": 0.9, "seed": seed}
    answer = client.completions.create(model=gen_queue, prompt="abc", **params)
    want = in_process(
        reference, {"prompt": "abc", "max_new_tokens": 8, "temperature": 0.9, "seed": seed}
    )
    assert answer.choices[0].text == want.text


# -- the native /embed and /jobs ---------------------------------------------------------------

NATIVE: list[tuple[dict[str, Any], str]] = [
    *[({"text": v}, "text") for v in ("", 5, "x" * 20_001, ["x"])],
    *[({"texts": v}, "texts") for v in ([], [""], "x", ["x"] * 257, [5])],
    *[({"text": "x", "deadline_ms": v}, "deadline_ms") for v in (0, -1, 86_400_001, "100", True)],
    *[({"text": "x", "priority": v}, "priority") for v in (-1, 16, "1", 1.0, True)],
    ({"text": "x", "foo": 1}, "foo"),
]


@pytest.mark.slow
def test_each_bad_native_parameter_is_a_422_locating_it(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
) -> None:
    http = serve(make_app(timeout_s=2))
    for path in ("/embed", "/jobs"):
        for body, param in NATIVE:
            response = http.post(path, json=body)
            assert response.status_code == 422, (path, body, response.text)
            loc = response.json()["detail"][0]["loc"]
            assert loc[:2] == ["body", param], (path, body, loc)
    # An integer is a number: a deadline of 100 ms (no worker: it expires, 504).
    response = http.post("/embed", json={"text": "x", "deadline_ms": 100, "priority": 2})
    assert response.status_code == 504, response.text
