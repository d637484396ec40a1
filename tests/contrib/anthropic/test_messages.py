"""Anthropic's Messages API (``/v1/messages``) of the FastAPI backend, end to end.

The app runs under uvicorn (test_fastapi's ``serve``), called with the official ``anthropic``
client and with raw httpx; requests go through the session's redis-server to a real worker
(a thread of this process) serving the tiny random Llama on the generation queue. Generated
texts are compared with the in-process generator on the same model (test_generate's
``reference``), token for token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import pytest
from pydantic import SecretStr

from ..openai.test_openai import MakeApp, gen_queue, make_app, workers
from ..test_fastapi import Serve, serve
from ..test_quota_http import REFUSED, refusing
from tests.support.models_for_tests import tiny_llama_tools
from tests.support.service import WorkerThread, spec
from tests.support.tool_schemas import TIME, WEATHER
from tests.worker.test_generate import in_process, reference

anthropic = pytest.importorskip("anthropic")

__all__ = ["gen_queue", "make_app", "reference", "refusing", "serve", "workers"]  # fixtures

QUESTION = "What is the capital of France?"


def client_for(http: httpx.Client, api_key: str | None = "unused") -> Any:
    """The official client pointed at the app (no retries: a test sees the first answer)."""
    return anthropic.Anthropic(
        base_url=str(http.base_url).rstrip("/"), api_key=api_key, max_retries=0
    )


def assert_error(response: httpx.Response, status: int, error_type: str) -> str:
    """The response is Anthropic's error object with this status and type; its message."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == error_type, body
    return str(body["error"]["message"])


@pytest.mark.slow
def test_the_anthropic_client_creates_and_streams_messages(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811 (the fixture imported above)
    workers: Callable[..., None],  # noqa: F811
    gen_queue: str,  # noqa: F811
    reference: Any,  # noqa: F811
) -> None:
    workers()
    http = serve(make_app())
    client = client_for(http)
    system = "You are terse."
    wire = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    want = in_process(reference, {"messages": wire, "max_new_tokens": 12})

    message = client.messages.create(
        model=gen_queue,
        max_tokens=12,
        system=system,
        messages=[{"role": "user", "content": QUESTION}],
    )
    assert message.id.startswith("msg_")
    assert (message.type, message.role, message.model) == ("message", "assistant", gen_queue)
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == want.text
    assert message.stop_reason == ("max_tokens" if want.finish_reason == "length" else "end_turn")
    assert message.stop_sequence is None
    assert message.usage.input_tokens == want.prompt_tokens
    assert message.usage.output_tokens == len(want.token_ids)

    # The system as text blocks, the turn as a text block: the same conversation.
    same = client.messages.create(
        model=gen_queue,
        max_tokens=12,
        system=[{"type": "text", "text": system}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
    )
    assert same.content == message.content

    # Streamed: the deltas join to the whole answer's text; the final message is the same.
    with client.messages.stream(
        model=gen_queue,
        max_tokens=12,
        system=system,
        messages=[{"role": "user", "content": QUESTION}],
    ) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == want.text
    assert final.content[0].text == want.text
    assert (final.stop_reason, final.stop_sequence) == (message.stop_reason, None)
    assert final.usage.input_tokens == want.prompt_tokens
    assert final.usage.output_tokens == len(want.token_ids)

    # Raw events: Anthropic's names and order.
    body = {
        "model": gen_queue,
        "max_tokens": 5,
        "stream": True,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    with http.stream("POST", "/v1/messages", json=body) as response:
        names = [
            line[len("event: ") :] for line in response.iter_lines() if line.startswith("event: ")
        ]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}

    # A token limit reached is max_tokens.
    short = client.messages.create(
        model=gen_queue, max_tokens=2, messages=[{"role": "user", "content": QUESTION}]
    )
    assert (short.stop_reason, short.usage.output_tokens) == ("max_tokens", 2)

    # A stop sequence cuts the text before it, and is named (the worker says which).
    full = in_process(
        reference, {"messages": [{"role": "user", "content": "abc"}], "max_new_tokens": 16}
    ).text
    stop = full[5:7]
    cut = client.messages.create(
        model=gen_queue,
        max_tokens=16,
        stop_sequences=["never there", stop],
        messages=[{"role": "user", "content": "abc"}],
    )
    assert cut.content[0].text == full[: full.index(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(
        model=gen_queue,
        max_tokens=16,
        stop_sequences=["never there", stop],
        messages=[{"role": "user", "content": "abc"}],
    ) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert streamed.content[0].text == cut.content[0].text

    # Counting tokens: the prompt as the worker renders it.
    count = client.messages.count_tokens(
        model=gen_queue, system=system, messages=[{"role": "user", "content": QUESTION}]
    )
    assert count.input_tokens == want.prompt_tokens


def test_bad_requests_get_anthropic_errors(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    gen_queue: str,  # noqa: F811
) -> None:
    # No worker: each is refused before anything is queued.
    http = serve(make_app())
    ok = {"model": gen_queue, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"anthropic-version": "2023-06-01"}

    def post(body: dict[str, Any]) -> httpx.Response:
        return http.post("/v1/messages", json=body, headers=headers)

    no_limit = {k: v for k, v in ok.items() if k != "max_tokens"}
    assert "max_tokens" in assert_error(post(no_limit), 400, "invalid_request_error")
    assert "foo" in assert_error(post({**ok, "foo": 1}), 400, "invalid_request_error")
    assert "temperature" in assert_error(
        post({**ok, "temperature": 1.5}), 400, "invalid_request_error"
    )
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    turn = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]
    message = assert_error(post({**ok, "messages": turn}), 400, "invalid_request_error")
    assert "image" in message
    assert "messages.0.content" in message
    prefill = [*ok["messages"], {"role": "assistant", "content": "The"}]
    assert "prefill" in assert_error(
        post({**ok, "messages": prefill}), 400, "invalid_request_error"
    )
    thinking = {"type": "enabled", "budget_tokens": 1024}
    assert "thinking" in assert_error(
        post({**ok, "thinking": thinking}), 400, "invalid_request_error"
    )
    assert "max_tokens" in assert_error(
        post({**ok, "max_tokens": "5"}), 400, "invalid_request_error"
    )
    assert_error(
        http.post("/v1/messages", content=b"{not json", headers=headers),
        400,
        "invalid_request_error",
    )
    deep = b'{"model": "m", "metadata": ' + b"[" * 100 + b"]" * 100 + b"}"
    assert_error(http.post("/v1/messages", content=deep), 400, "invalid_request_error")
    assert "claude-x" in assert_error(post({**ok, "model": "claude-x"}), 404, "not_found_error")
    # Tools are checked as the worker reads them, their schemas compiled, before queuing.
    tool = {"name": "f", "input_schema": {"type": "object"}}
    unknown = {"type": "tool", "name": "g"}
    message = assert_error(
        post({**ok, "tools": [tool], "tool_choice": unknown}), 400, "invalid_request_error"
    )
    assert "tool_choice" in message
    bad = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": 5}}}}
    message = assert_error(post({**ok, "tools": [bad]}), 400, "invalid_request_error")
    assert message.startswith("tools")
    used = [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
        },
        *ok["messages"],
    ]
    message = assert_error(post({**ok, "messages": used}), 400, "invalid_request_error")
    assert "need tools" in message
    counted = http.post("/v1/messages/count_tokens", json={**no_limit, "tools": [tool]})
    assert "tools" in assert_error(counted, 400, "invalid_request_error")

    client = client_for(http)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=gen_queue, max_tokens=5, messages=turn)
    with pytest.raises(anthropic.NotFoundError) as found:
        client.messages.create(model="claude-x", max_tokens=5, messages=ok["messages"])
    assert found.value.body["error"]["type"] == "not_found_error"
    # The OpenAI routes beside keep OpenAI's shape.
    assert "error" in http.post("/v1/chat/completions", json={"model": gen_queue}).json()


def test_a_missing_or_wrong_key_is_anthropics_401(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    gen_queue: str,  # noqa: F811
) -> None:
    http = serve(make_app(api_key=SecretStr("sk-right-0123456789abcdef")))
    ok = {"model": gen_queue, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    assert_error(http.post("/v1/messages", json=ok), 401, "authentication_error")
    wrong = {"x-api-key": "sk-wrong"}
    assert_error(http.post("/v1/messages", json=ok, headers=wrong), 401, "authentication_error")
    assert_error(http.post("/v1/messages/count_tokens", json=ok), 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        client_for(http, "sk-wrong").messages.create(**ok)
    # The right key in x-api-key passes the check (no worker: the wrong model is 404).
    right = {"x-api-key": "sk-right-0123456789abcdef"}
    response = http.post("/v1/messages", json={**ok, "model": "other"}, headers=right)
    assert_error(response, 404, "not_found_error")
    # OpenAI's routes keep OpenAI's 401.
    assert http.post("/v1/chat/completions", json={}).json()["error"]["code"] == "invalid_api_key"


def test_a_tenant_over_its_quota_is_anthropics_429(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    gen_queue: str,  # noqa: F811
    refusing: None,  # noqa: F811
) -> None:
    http = serve(make_app())
    ok = {"model": gen_queue, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    response = http.post("/v1/messages", json=ok)
    assert str(REFUSED) in assert_error(response, 429, "rate_limit_error")
    assert (response.headers["retry-after"], response.headers["retry-after-ms"]) == ("2", "1200")
    with pytest.raises(anthropic.RateLimitError):
        client_for(http).messages.create(**ok)


TOOLS = [
    {"name": "weather", "description": "The forecast of a city", "input_schema": WEATHER},
    {"name": "time", "input_schema": TIME},
]
SCHEMAS = {"weather": WEATHER, "time": TIME}


@pytest.fixture(scope="module")
def tools_reference() -> Any:
    """The in-process generator on the tiny random Llama that writes calls."""
    from batchline.generation import SyncGenerator

    model, tokenizer = tiny_llama_tools()
    with SyncGenerator(model, tokenizer=tokenizer, max_batch_size=1) as generator:
        yield generator


def calls_of(message: Any) -> list[tuple[str, Any]]:
    """The ``tool_use`` blocks of a message: (name, input) each, their ids checked."""
    blocks = [b for b in message.content if b.type == "tool_use"]
    assert all(b.id.startswith("toolu_") for b in blocks), blocks
    assert len({b.id for b in blocks}) == len(blocks)
    return [(b.name, b.input) for b in blocks]


@pytest.mark.slow
def test_tools_calls_validate_stream_and_their_results_go_back(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,  # noqa: F811
    tools_reference: Any,
) -> None:
    start_worker("generate", model_path=spec("tiny_llama_tools"), queue=gen_queue)
    client = client_for(serve(make_app(embedding_queue=None)))
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]

    # "any": the model must call; each call's input validates against its tool's schema.
    one = {"type": "any", "disable_parallel_tool_use": True}
    message = client.messages.create(
        model=gen_queue, max_tokens=120, tools=TOOLS, tool_choice=one, messages=ask
    )
    calls = calls_of(message)
    assert len(calls) == 1, message.content
    jsonschema.validate(calls[0][1], SCHEMAS[calls[0][0]])
    assert message.stop_reason == "tool_use"
    assert message.stop_sequence is None
    # Parallel calls allowed: one or more, each valid.
    several = client.messages.create(
        model=gen_queue, max_tokens=120, tools=TOOLS, tool_choice={"type": "any"}, messages=ask
    )
    assert several.stop_reason == "tool_use"
    assert calls_of(several), several.content
    for name, arguments in calls_of(several):
        jsonschema.validate(arguments, SCHEMAS[name])

    # A named tool, one call at most: that tool, once.
    named = client.messages.create(
        model=gen_queue,
        max_tokens=120,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "time", "disable_parallel_tool_use": True},
        messages=ask,
    )
    assert [name for name, _ in calls_of(named)] == ["time"]
    jsonschema.validate(calls_of(named)[0][1], TIME)

    # Streamed (greedy): the same calls, their input_json_delta pieces joined.
    with client.messages.stream(
        model=gen_queue, max_tokens=120, tools=TOOLS, tool_choice=one, messages=ask
    ) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert calls_of(final) == calls
    assert set(deltas) == {"input_json_delta"}
    assert final.stop_reason == "tool_use"

    # The calls and their results go back: the worker is fed the same conversation as the
    # in-process generator given it in OpenAI's shape.
    results = [
        {"type": "tool_result", "tool_use_id": b.id, "content": f"result {i}"}
        for i, b in enumerate(b for b in message.content if b.type == "tool_use")
    ]
    turns = [
        *ask,
        {
            "role": "assistant",
            "content": [b.model_dump(exclude_none=True) for b in message.content],
        },
        {"role": "user", "content": [*results, {"type": "text", "text": "And tomorrow?"}]},
    ]
    answer = client.messages.create(
        model=gen_queue, max_tokens=8, tools=TOOLS, tool_choice={"type": "none"}, messages=turns
    )
    openai_turns = [
        *ask,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
                for b in message.content
                if b.type == "tool_use"
            ],
        },
        *(
            {"role": "tool", "tool_call_id": r["tool_use_id"], "content": r["content"]}
            for r in results
        ),
        {"role": "user", "content": "And tomorrow?"},
    ]
    want = tools_reference.generate(
        messages=openai_turns,
        tools=[
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    **({"description": t["description"]} if "description" in t else {}),
                    "parameters": t["input_schema"],
                },
            }
            for t in TOOLS
        ],
        tool_choice="none",
        max_new_tokens=8,
    )
    assert [b.type for b in answer.content] == (["text"] if want.text else [])
    assert "".join(b.text for b in answer.content) == want.text
    assert answer.usage.input_tokens == want.prompt_tokens


@pytest.mark.timeout(300)  # the first run ever converts the GGUF file (about a minute)
@pytest.mark.slow
def test_smollm2_answers_the_anthropic_client_and_calls_a_tool(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,  # noqa: F811
) -> None:
    start_worker("generate", queue=gen_queue)  # SmolLM2-135M-Instruct
    client = client_for(serve(make_app(embedding_queue=None, timeout_s=240)))
    ask = [{"role": "user", "content": QUESTION}]
    message = client.messages.create(model=gen_queue, max_tokens=20, messages=ask)
    assert "Paris" in message.content[0].text
    assert message.stop_reason == "end_turn"
    with client.messages.stream(model=gen_queue, max_tokens=20, messages=ask) as stream:
        assert "".join(stream.text_stream) == message.content[0].text

    weather = [{"role": "user", "content": "What will the weather be in Paris for 3 days?"}]
    called = client.messages.create(
        model=gen_queue,
        max_tokens=60,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
        messages=weather,
    )
    [(name, arguments)] = calls_of(called)
    assert name == "weather"
    jsonschema.validate(arguments, WEATHER)
    assert called.stop_reason == "tool_use"


def test_stop_reasons_and_blocks_from_the_workers_output() -> None:
    from batchline.contrib.anthropic._schema import content, stop_reason, stop_sequence

    def output(reason: str, **more: Any) -> dict[str, Any]:
        return {"text": "hi", "finish_reason": reason, "tokens": 2, "prompt_tokens": 3, **more}

    said = output("stop", stop_sequence="b")
    assert (stop_reason(said, ["a", "b"]), stop_sequence(said, ["a", "b"])) == (
        "stop_sequence",
        "b",
    )
    # A worker older than stop_sequence: the one given, else none named.
    assert stop_sequence(output("stop"), ["a"]) == "a"
    assert stop_sequence(output("stop"), ["a", "b"]) is None
    assert [stop_reason(output(r), None) for r in ("eos", "length", "cancelled")] == [
        "end_turn",
        "max_tokens",
        "max_tokens",
    ]
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    cut = {**call, "function": {"name": "f", "arguments": '{"a'}}
    calls = output("length", content=None, tool_calls=[call, cut])
    assert content(calls) == [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]
    assert stop_reason(calls, None) == "max_tokens"
    done = output("stop", content="", tool_calls=[call])
    assert (stop_reason(done, ["x"]), stop_sequence(done, ["x"])) == ("tool_use", None)
    with pytest.raises(ValueError, match="not JSON"):
        content(output("stop", content=None, tool_calls=[cut]))
