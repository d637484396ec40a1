"""``/v1/responses`` with the official ``openai`` client, under uvicorn, against the
session's redis-server and a generation worker serving the tiny random Llama (greedy: a
text is the in-process generator's, token for token)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis
from pydantic import SecretStr

from batchline.acl import acl_rules
from batchline.config import WebSettings
from batchline.contrib.fastapi import create_app
from batchline.keys import QueueKeys, ResponsesKeys
from batchline.producer import Producer

from ..batches.test_batches import api_process
from ..test_fastapi import Serve, serve
from ..test_keys import Keys
from ..test_tenant_requests import keyed_app
from .test_openai import MakeApp, assert_error, client_for, gen_queue, make_app
from tests.support.models_for_tests import StepGate
from tests.support.scale_security import named_acl_users
from tests.support.service import WorkerThread, spec, stop_all
from tests.worker.test_generate import TINY, in_process, poll, reference

openai = pytest.importorskip("openai")

__all__ = ["gen_queue", "keyed_app", "make_app", "reference", "serve"]  # fixtures, used here

QUESTION = "What is the capital of France?"


@pytest.fixture
def api(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,  # noqa: F811
) -> httpx.Client:
    """The app (generation queue only) and a worker serving the tiny Llama."""
    start_worker("generate", model_path=TINY, queue=gen_queue, default_max_new_tokens=16)
    return serve(make_app(embedding_queue=None))


def chat(reference: Any, messages: list[dict[str, str]], **options: Any) -> Any:  # noqa: F811
    """What the in-process generator answers for these messages."""
    return in_process(reference, {"messages": messages, **options})


@pytest.mark.slow
def test_create_retrieve_chain_and_list_input_items(
    api: httpx.Client,
    gen_queue: str,  # noqa: F811
    reference: Any,  # noqa: F811
) -> None:
    client = client_for(api)
    first = client.responses.create(
        model=gen_queue, input=QUESTION, instructions="Be brief.", max_output_tokens=9
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    want = chat(reference, messages, max_new_tokens=9)
    assert first.status == ("incomplete" if want.finish_reason == "length" else "completed")
    assert first.output_text == want.text
    assert first.usage is not None
    assert first.usage.output_tokens == want.tokens
    assert first.instructions == "Be brief."
    assert (first.temperature, first.top_p) == (None, None)  # the worker's: greedy
    again = client.responses.retrieve(first.id)
    assert again.model_dump() == first.model_dump()

    # The conversation goes on: the previous input and output come first (not its
    # instructions, as OpenAI's).
    second = client.responses.create(
        model=gen_queue,
        previous_response_id=first.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "And Italy?"}]}],
    )
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": want.text},
        {"role": "user", "content": "And Italy?"},
    ]
    assert second.output_text == chat(reference, messages).text
    assert second.previous_response_id == first.id

    items = client.responses.input_items.list(second.id, order="asc")
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "And Italy?")]

    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


@pytest.mark.slow
def test_streamed_events_and_a_resumed_stream(
    api: httpx.Client,
    gen_queue: str,  # noqa: F811
    reference: Any,  # noqa: F811
) -> None:
    client = client_for(api)
    want = chat(reference, [{"role": "user", "content": QUESTION}])
    events = list(client.responses.create(model=gen_queue, input=QUESTION, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want.text == events[-1].response.output_text

    # The client's stream helper, which accumulates the response from the events (its
    # final response needs response.completed: the 16 tokens of the tiny model end on the
    # token limit, response.incomplete; the last event's response is the same object).
    with client.responses.stream(model=gen_queue, input=QUESTION) as helper:
        got = list(helper)
    assert "".join(e.delta for e in got if e.type == "response.output_text.delta") == want.text
    assert got[-1].response.output_text == want.text
    with client.responses.stream(response_id=got[-1].response.id, starting_after=3) as resumed:
        rest = list(resumed)
    assert "".join(e.delta for e in rest if e.type == "response.output_text.delta") == want.text

    # Resumed after any event: the rest, each once, and the text joined is the same.
    rid = events[0].response.id
    for cut in (0, 3, len(events) // 2, len(events) - 2):
        rest = list(client.responses.retrieve(rid, stream=True, starting_after=cut))
        assert [e.sequence_number for e in rest] == list(range(cut + 1, len(events)))
        assert [e.model_dump() for e in rest] == [e.model_dump() for e in events[cut + 1 :]]


@pytest.mark.slow
def test_text_format_json_schema(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,  # noqa: F811
) -> None:
    # A model whose tokenizer is a fast one (structured output needs it).
    start_worker("generate", model_path=spec("tiny_llama_chars"), queue=gen_queue)
    client = client_for(serve(make_app(embedding_queue=None)))
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    shaped = client.responses.create(
        model=gen_queue,
        input=QUESTION,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
    )
    assert shaped.text.format.type == "json_schema"
    if shaped.status == "completed":
        assert set(json.loads(shaped.output_text)) == {"city"}
    else:  # the token limit: the JSON is cut, and closed by the worker
        assert shaped.status == "incomplete"
    bad = {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=gen_queue, input="x", text={"format": bad})
    assert refused.value.param == "text.format"


@pytest.mark.slow
def test_a_background_response_cancelled_ends_its_generation(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,  # noqa: F811
    gate: StepGate,
    redis_url: str,
) -> None:
    start_worker("generate", model_path=spec("tiny_llama_gated"), queue=gen_queue)
    client = client_for(serve(make_app(embedding_queue=None)))
    started = client.responses.create(
        model=gen_queue, input=QUESTION, background=True, max_output_tokens=500
    )
    assert started.status == "in_progress"
    assert started.background
    gate.allow(3)  # it runs: the prefill and two tokens, then waits
    gate.wait_passes(3)
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    gate.open()
    # Its worker ended the generation at its next step, well before its 500 tokens.
    record = redis.Redis.from_url(redis_url).hget(ResponsesKeys().response(started.id), "rid")
    assert record is not None
    with Producer(redis_url=redis_url, queue=gen_queue) as producer:
        result = poll(producer, json.loads(record))
    assert result.output["finish_reason"] == "cancelled"
    assert result.output["tokens"] < 500
    again = client.responses.retrieve(started.id)
    assert again.status == "cancelled"
    assert client.responses.cancel(started.id).status == "cancelled"  # as it is


@pytest.mark.slow
def test_stored_responses_expire_and_the_oldest_is_evicted(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,  # noqa: F811
    rclient: redis.Redis,
) -> None:
    start_worker("generate", model_path=TINY, queue=gen_queue, default_max_new_tokens=2)
    app = make_app(embedding_queue=None, responses_max=2, responses_ttl_s=600)
    client = client_for(serve(app))
    made = [client.responses.create(model=gen_queue, input=f"n{i}") for i in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[0].id)
    keys = ResponsesKeys()
    for response in made[1:]:
        assert client.responses.retrieve(response.id).id == response.id
        for key in (keys.response(response.id), keys.events(response.id)):
            assert 0 < rclient.ttl(key) <= 600
    assert not rclient.exists(keys.response(made[0].id), keys.events(made[0].id))


@pytest.mark.slow
def test_refused_parameters_name_themselves(api: httpx.Client, gen_queue: str) -> None:  # noqa: F811
    base = {"model": gen_queue, "input": QUESTION}
    for extra, param in (
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}}, "tool_choice"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"store": False, "background": True}, "background"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ):
        status = 404 if param == "previous_response_id" else 400
        error = assert_error(api.post("/v1/responses", json={**base, **extra}), status)
        assert param in (error["param"] or "") + error["message"], error
    for extra, param in (  # the schema's own refusals: `param` names the field
        ({"truncation": "auto"}, "truncation"),
        ({"max_tool_calls": 3}, "max_tool_calls"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"metadata": {str(i): "x" for i in range(17)}}, "metadata"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"store": "yes"}, "store"),
        ({"instructions": 5}, "instructions"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ):
        error = assert_error(api.post("/v1/responses", json={**base, **extra}), 400)
        assert error["param"] == param, (extra, error)
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
    error = assert_error(api.post("/v1/responses", json={**base, "input": image}), 400)
    assert "input_image" in error["message"]
    assert_error(api.get("/v1/responses/resp_unknown"), 404)
    limit = assert_error(api.get("/v1/responses/resp_unknown/input_items?limit=0"), 400)
    assert limit["param"] == "limit", limit
    # Not a background response: no cancel.
    plain = api.post("/v1/responses", json={**base, "max_output_tokens": 2}).json()
    assert_error(api.post(f"/v1/responses/{plain['id']}/cancel"), 400)


@pytest.mark.slow
def test_a_background_stream_outlives_its_killed_api_and_resumes_on_another(
    redis_url: str,
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,  # noqa: F811
    gate: StepGate,
) -> None:
    """Two API processes: the one that took a streamed background response is SIGKILLed
    mid-generation; the other resumes its stream after the last event seen (each event
    once, the text joined equal to an unbroken run's) and retrieves it complete."""
    start_worker("generate", model_path=spec("tiny_llama_gated"), queue=gen_queue)
    env = {
        "BATCHLINE_REDIS_URL": redis_url,
        "BATCHLINE_QUEUE": gen_queue,
        "BATCHLINE_GENERATION_QUEUE": gen_queue,
        "BATCHLINE_BATCH_DRIVER": "off",
    }
    with api_process(env) as other:
        seen: list[Any] = []
        with api_process(env) as first:
            stream = client_for(first).responses.create(
                model=gen_queue, input=QUESTION, background=True, stream=True
            )
            gate.allow(8)  # the prefill and 7 of its 16 tokens: then the worker waits
            for event in stream:
                seen.append(event)
                if event.type == "response.output_text.delta":
                    break
        # Leaving the block SIGKILLed the first API, its stream's connection with it.
        assert [e.sequence_number for e in seen] == list(range(len(seen)))
        rid = seen[0].response.id
        gate.open()
        client = client_for(other)
        rest = list(client.responses.retrieve(rid, stream=True, starting_after=len(seen) - 1))
        assert [e.sequence_number for e in rest] == list(range(len(seen), len(seen) + len(rest)))
        assert rest[-1].type in ("response.completed", "response.incomplete")
        joined = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
        done = client.responses.retrieve(rid)
        assert done.status == rest[-1].response.status
        unbroken = client.responses.create(model=gen_queue, input=QUESTION)
        assert joined == done.output_text == unbroken.output_text
        assert done.usage is not None
        assert unbroken.usage is not None
        assert done.usage.output_tokens == unbroken.usage.output_tokens


@pytest.mark.slow
def test_a_tenant_sees_only_its_own_responses(
    keyed_app: MakeApp,
    redis_url: str,
    start_worker: Callable[..., WorkerThread],
    queue: str,
    gen_queue: str,  # noqa: F811
) -> None:
    start_worker(
        "generate", model_path=TINY, queue=gen_queue, prefix=queue, default_max_new_tokens=4
    )
    store = Keys(redis_url, queue)
    alice, bob, admin = (store.create(t, admin=t == "ops")[0] for t in ("alice", "bob", "ops"))
    http, _ = keyed_app(generation_queue=gen_queue, batch_driver="off")
    as_alice, as_bob, as_admin = (
        client_for(http).with_options(api_key=key) for key in (alice, bob, admin)
    )
    mine = as_alice.responses.create(model=gen_queue, input=QUESTION)
    assert mine.status in ("completed", "incomplete")
    for call in (
        lambda: as_bob.responses.retrieve(mine.id),
        lambda: as_bob.responses.input_items.list(mine.id),
        lambda: as_bob.responses.delete(mine.id),
        lambda: as_bob.responses.create(
            model=gen_queue, input="more", previous_response_id=mine.id
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert as_admin.responses.retrieve(mine.id).output_text == mine.output_text
    assert as_alice.responses.retrieve(mine.id).id == mine.id
    # Its generation ran in alice's name: its request id is in her namespace.
    raw = redis.Redis.from_url(redis_url).hgetall(ResponsesKeys(queue).response(mine.id))
    assert json.loads(raw[b"rid"]).startswith("alice.")


WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.mark.slow
def test_function_tools_called_answered_and_streamed(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,  # noqa: F811
) -> None:
    start_worker("generate", model_path=spec("tiny_llama_tools"), queue=gen_queue)
    client = client_for(serve(make_app(embedding_queue=None)))
    asked = {
        "model": gen_queue,
        "input": "Weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 120,
    }
    # A function's parameters a worker could not compile: refused before anything is queued.
    bad = {**WEATHER, "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{**asked, "tools": [bad]})
    assert refused.value.param == "tools"
    called = client.responses.create(**asked)
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1, called.output
    assert calls[0].name == "weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}  # constrained: it parses
    assert called.tools[0].name == "weather"

    # Its output goes back: the conversation continues with the call's result.
    answered = client.responses.create(
        model=gen_queue,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=5,
    )
    assert answered.status in ("completed", "incomplete")
    assert [i.type for i in answered.output] == ["message"]
    items = client.responses.input_items.list(answered.id)
    assert [(i.type, i.output) for i in items.data] == [("function_call_output", "sunny")]

    # Streamed, its arguments come as OpenAI's events; the same call (greedy).
    events = list(client.responses.create(**asked, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == calls[0].arguments
    assert events[-1].response.output[-1].arguments == calls[0].arguments


@pytest.mark.slow
def test_a_background_response_cut_short_with_its_api_runs_again_elsewhere(
    redis_url: str,
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker ends a streamed generation whose API stopped reading its chunks (here
    within 0.2 s): the response that API took is not lost with it, another replica runs
    its generation again under its id and completes it, the text the same."""
    monkeypatch.setenv("BLTEST_STEP_S", "0.01")  # 300 tokens: 3 s at least
    start_worker("generate", model_path=TINY, queue=gen_queue, stream_max_unread_s=0.2)
    env = {
        "BATCHLINE_REDIS_URL": redis_url,
        "BATCHLINE_QUEUE": gen_queue,
        "BATCHLINE_GENERATION_QUEUE": gen_queue,
        "BATCHLINE_BATCH_DRIVER": "off",
    }
    asked = {"model": gen_queue, "input": QUESTION, "max_output_tokens": 300}
    with api_process(env) as other:
        seen: list[Any] = []
        with api_process(env) as first:
            for event in client_for(first).responses.create(**asked, background=True, stream=True):
                seen.append(event)
                if event.type == "response.output_text.delta":
                    break
        client = client_for(other)
        rid = seen[0].response.id
        rest = list(client.responses.retrieve(rid, stream=True, starting_after=len(seen) - 1))
        joined = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
        done = client.responses.retrieve(rid)
        assert done.status == "incomplete"  # its 300 tokens: not the cut-short run's end
        assert done.usage is not None
        assert done.usage.output_tokens == 300
        assert joined == done.output_text == client.responses.create(**asked).output_text


@pytest.mark.slow
def test_responses_under_the_acl_users_batchline_acl_prints(
    redis_url: str,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    queue: str,
) -> None:
    """The backend under the producer user with ``--responses``' rules, the worker under
    the worker user: a response is stored, streamed and resumed; the plain producer user
    may not touch a response's keys."""
    keys = QueueKeys(queue, prefix=queue)
    rules = {
        "api": acl_rules(keys, "producer", responses=True),
        "plain": acl_rules(keys, "producer"),
        "worker": acl_rules(keys, "worker"),
    }
    with named_acl_users(redis_url, queue[-8:], rules) as urls:
        worker = start_worker(
            "generate",
            model_path=TINY,
            prefix=queue,
            redis_url=urls["worker"],
            default_max_new_tokens=4,
        )
        try:
            _under_the_users(serve, urls, queue)
        finally:
            stop_all([worker])  # before its user goes


def _under_the_users(serve: Serve, urls: dict[str, str], queue: str) -> None:
    """A response stored, streamed and resumed by the app under the ``api`` user; the
    ``plain`` user may not read its keys."""
    settings = WebSettings(
        redis_url=SecretStr(urls["api"]), queue=queue, prefix=queue, generation_queue=queue
    )
    client = client_for(serve(create_app(settings, timeout_s=30)))
    events = list(client.responses.create(model=queue, input=QUESTION, stream=True))
    rid = events[0].response.id
    assert events[-1].type in ("response.completed", "response.incomplete")
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=1))
    assert len(rest) == len(events) - 2
    assert client.responses.retrieve(rid).output_text == events[-1].response.output_text
    plain = redis.Redis.from_url(urls["plain"])
    with pytest.raises(redis.exceptions.NoPermissionError):
        plain.hgetall(ResponsesKeys(queue).response(rid))
    plain.close()


@pytest.fixture
def impatient(make_app: MakeApp, serve: Serve) -> httpx.Client:  # noqa: F811
    """The app (generation queue only) waiting 0.5 s for an answer, or a stream's chunk;
    no worker."""
    return serve(make_app(embedding_queue=None, timeout_s=0.5))


def test_an_unstored_stream_with_no_chunk_in_time_fails_and_is_cancelled(
    impatient: httpx.Client,
    gen_queue: str,
    rclient: redis.Redis,  # noqa: F811
) -> None:
    """``store: false, stream: true``: no chunk within the app's timeout_s (no worker here)
    ends the stream with ``response.failed`` (``server_error``, the timeout's message), as a
    chat's stream ends, and the request is cancelled."""
    from .test_openai import sse_events
    from tests.support.service import cancelled_ids, wait_until

    body = {"model": gen_queue, "input": QUESTION, "stream": True, "store": False}
    with impatient.stream("POST", "/v1/responses", json=body) as response:
        events = [json.loads(e) for e in sse_events(response)]
    assert events[-1]["type"] == "response.failed", events[-1]
    error = events[-1]["response"]["error"]
    assert error["code"] == "server_error", error
    assert error["message"].startswith("no new text within 0.5 s"), error
    wait_until(lambda: cancelled_ids(rclient, QueueKeys(gen_queue)), "the cancel")


@pytest.mark.slow
def test_an_unstored_stream_that_fails_names_the_code_a_stored_one_would(
    api: httpx.Client,
    gen_queue: str,  # noqa: F811
) -> None:
    """A prompt too long for the model fails an unstored stream with ``invalid_prompt``, the
    code a stored response's failure has (not the error's own type)."""
    from .test_openai import sse_events

    body = {"model": gen_queue, "input": "x" * 5000, "stream": True, "store": False}
    with api.stream("POST", "/v1/responses", json=body) as response:
        events = [json.loads(e) for e in sse_events(response)]
    assert events[-1]["type"] == "response.failed", events[-1]
    assert events[-1]["response"]["error"]["code"] == "invalid_prompt", events[-1]
