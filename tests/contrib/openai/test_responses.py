"""``/v1/responses`` with the official ``openai`` client, under uvicorn, against the
session's redis-server and a generation worker serving the tiny random Llama (greedy: a
text is the in-process generator's, token for token)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from ..test_fastapi import Serve, serve
from .test_openai import MakeApp, assert_error, client_for, gen_queue, make_app
from tests.support.service import WorkerThread, spec
from tests.worker.test_generate import TINY, in_process, reference

openai = pytest.importorskip("openai")

__all__ = ["gen_queue", "make_app", "reference", "serve"]  # fixtures, used here

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
def test_background_and_cancel(api: httpx.Client, gen_queue: str) -> None:  # noqa: F811
    client = client_for(api)
    started = client.responses.create(
        model=gen_queue, input=QUESTION, background=True, max_output_tokens=1000
    )
    assert started.status == "in_progress"
    assert started.background
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status in ("cancelled", "completed", "incomplete")
    assert client.responses.retrieve(started.id).status == cancelled.status


@pytest.mark.slow
def test_refused_parameters_name_themselves(api: httpx.Client, gen_queue: str) -> None:  # noqa: F811
    base = {"model": gen_queue, "input": QUESTION}
    for extra, param in (
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"store": False, "background": True}, "background"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ):
        status = 404 if param == "previous_response_id" else 400
        error = assert_error(api.post("/v1/responses", json={**base, **extra}), status)
        assert param in (error["param"] or "") + error["message"], error
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
    error = assert_error(api.post("/v1/responses", json={**base, "input": image}), 400)
    assert "input_image" in error["message"]
    assert_error(api.get("/v1/responses/resp_unknown"), 404)
    # Not a background response: no cancel.
    plain = api.post("/v1/responses", json={**base, "max_output_tokens": 2}).json()
    assert_error(api.post(f"/v1/responses/{plain['id']}/cancel"), 400)
