"""The OpenAI-compatible routes (``/v1``) of the FastAPI backend, end to end.

The app runs under uvicorn (test_fastapi's ``serve``), called with the official ``openai``
client and with raw httpx; requests go through the session's redis-server to real workers
(threads of this process): ``web_models.embed`` on the embedding queue and the tiny random
Llama on the generation queue. Generated texts are compared with the in-process generator on
the same model (test_generate's ``reference``), token for token.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from fastapi import FastAPI
from pydantic import SecretStr

from batchline.config import WebSettings
from batchline.contrib.fastapi import create_app
from batchline.keys import QueueKeys
from batchline.producer import Producer

from ..test_fastapi import MODEL, Serve, serve
from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, cancelled_ids, spec, wait_until
from tests.support.web_models import BAD_INPUT, MODEL_FAILURE, vector
from tests.worker.test_generate import CHAT, TINY, in_process, poll, reference

openai = pytest.importorskip("openai")

__all__ = ["reference", "serve"]  # fixtures, used here

MakeApp = Callable[..., FastAPI]


@pytest.fixture
def gen_queue(queue: str) -> str:
    return f"{queue}-gen"


@pytest.fixture
def make_app(redis_url: str, queue: str, gen_queue: str) -> MakeApp:
    """``make_app(**settings)``: the app with ``queue`` as the embedding queue and
    ``gen_queue`` as the generation queue (``embedding_queue=None`` etc. leave one out)."""

    def make(*, timeout_s: float | None = RESULT_TIMEOUT_S, **settings: Any) -> FastAPI:
        settings.setdefault("embedding_queue", queue)
        settings.setdefault("generation_queue", gen_queue)
        return create_app(
            WebSettings(redis_url=SecretStr(redis_url), queue=queue, **settings),
            timeout_s=timeout_s,
        )

    return make


@pytest.fixture
def workers(start_worker: Callable[..., WorkerThread], gen_queue: str) -> Callable[..., None]:
    """``workers(model_path=TINY, **generation settings)``: an embedding worker and a
    generation worker (max 16 new tokens by default, as ``in_process`` assumes)."""

    def start(model_path: str = TINY, **settings: Any) -> None:
        settings.setdefault("default_max_new_tokens", 16)
        start_worker(MODEL)
        start_worker("generate", model_path=model_path, queue=gen_queue, **settings)

    return start


def client_for(http: httpx.Client) -> Any:
    """The official client pointed at the app (no retries: a test sees the first answer)."""
    return openai.OpenAI(
        base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="unused", max_retries=0
    )


def assert_error(response: httpx.Response, status: int, **fields: Any) -> dict[str, Any]:
    """The response is OpenAI's error object with this status (and these fields)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for name, want in fields.items():
        assert error[name] == want, error
    return dict(error)


@pytest.mark.slow
def test_the_openai_client_embeds_completes_and_chats(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811 (the fixture imported above)
    workers: Callable[..., None],
    queue: str,
    gen_queue: str,
    reference: Any,  # noqa: F811
) -> None:
    workers()
    http = serve(make_app())
    client = client_for(http)

    assert sorted(m.id for m in client.models.list()) == sorted([queue, gen_queue])
    assert client.models.retrieve(gen_queue).owned_by == "batchline"

    # Embeddings: the client asks for base64 unless told; both decode to the same floats.
    one = client.embeddings.create(model=queue, input="hello")
    assert one.data[0].embedding == vector("hello")
    assert one.usage.prompt_tokens == 0  # a batch function's result carries no token count
    several = client.embeddings.create(model=queue, input=["a", "bb"], encoding_format="float")
    assert [d.embedding for d in several.data] == [vector("a"), vector("bb")]
    assert [d.index for d in several.data] == [0, 1]

    # A completion and a chat, greedy: the in-process generator's text, token counts, end.
    completion = client.completions.create(model=gen_queue, prompt="Once upon a time", max_tokens=9)
    want = in_process(reference, {"prompt": "Once upon a time", "max_new_tokens": 9})
    assert completion.choices[0].text == want.text
    assert completion.choices[0].finish_reason == (
        "length" if want.finish_reason == "length" else "stop"
    )
    assert completion.usage.prompt_tokens == want.prompt_tokens
    assert completion.usage.completion_tokens == len(want.token_ids)
    assert completion.usage.total_tokens == want.prompt_tokens + len(want.token_ids)
    assert (completion.model, completion.object) == (gen_queue, "text_completion")

    chat = client.chat.completions.create(model=gen_queue, messages=CHAT)
    want = in_process(reference, {"messages": CHAT})  # the worker's default: 16 tokens
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == want.text
    assert chat.usage.completion_tokens == len(want.token_ids)
    assert chat.object == "chat.completion"

    # Sampling parameters reach the worker: the same seed gives the in-process tokens.
    sampled = client.chat.completions.create(
        model=gen_queue, messages=CHAT, max_tokens=12, temperature=0.9, top_p=0.95, seed=7
    )
    want = in_process(
        reference,
        {"messages": CHAT, "max_new_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 7},
    )
    assert sampled.choices[0].message.content == want.text

    # A stop string cuts the text before it and reads as OpenAI's "stop".
    greedy = in_process(reference, {"prompt": "abc", "max_new_tokens": 16}).text
    stop = greedy[5:7]
    cut = client.completions.create(model=gen_queue, prompt="abc", max_tokens=16, stop=[stop])
    assert cut.choices[0].text == greedy[: greedy.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_bad_requests_get_openai_errors(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    workers: Callable[..., None],
    queue: str,
    gen_queue: str,
) -> None:
    workers(max_new_tokens_limit=50, max_batch_tokens=100)
    http = serve(make_app())
    chat = {"model": gen_queue, "messages": CHAT}

    assert_error(http.post("/v1/chat/completions", json={**chat, "n": 17}), 400, param="n")
    for name, value in [("top_logprobs", 21), ("tools", [{"type": "function"}]), ("foo", 1)]:
        response = http.post("/v1/chat/completions", json={**chat, name: value})
        assert_error(response, 400, param=name, type="invalid_request_error")
    response = http.post("/v1/chat/completions", json={**chat, "messages": []})
    assert_error(response, 400, param="messages")
    response = http.post("/v1/completions", json={"model": gen_queue, "prompt": [1, 2]})
    assert_error(response, 400)
    response = http.post("/v1/embeddings", json={"model": queue, "input": ""})
    assert_error(response, 400)

    # The model must be the route's served name.
    response = http.post("/v1/chat/completions", json={**chat, "model": "gpt-4o"})
    assert "gpt-4o" in assert_error(response, 404, code="model_not_found")["message"]
    response = http.post("/v1/embeddings", json={"model": gen_queue, "input": "x"})
    assert_error(response, 400, param="model")
    assert_error(http.get("/v1/models/gpt-4o"), 404, code="model_not_found")
    assert_error(http.get("/v1/no-such-route"), 404)

    # What the worker refuses is the client's fault: 400.
    response = http.post("/v1/chat/completions", json={**chat, "max_tokens": 51})
    assert (
        "max_new_tokens_limit" in assert_error(response, 400, code="BadGenerationParams")["message"]
    )
    response = http.post("/v1/completions", json={"model": gen_queue, "prompt": "x" * 200})
    assert_error(response, 400, code="context_length_exceeded")
    response = http.post("/v1/embeddings", json={"model": queue, "input": BAD_INPUT})
    assert_error(response, 400, code="ValueError")
    # What the model broke on is the server's: 500.
    response = http.post("/v1/embeddings", json={"model": queue, "input": [MODEL_FAILURE]})
    assert_error(response, 500, type="server_error", code="RuntimeError")

    # The official client raises its own typed errors for these answers.
    client = client_for(http)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=gen_queue, messages=CHAT, n=17)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")

    # base64 embeddings are little-endian float32.
    response = http.post(
        "/v1/embeddings", json={"model": queue, "input": "héllo", "encoding_format": "base64"}
    )
    raw = base64.b64decode(response.json()["data"][0]["embedding"])
    assert np.frombuffer(raw, "<f4").tolist() == vector("héllo")


def test_a_route_without_its_queue_says_which_setting_to_set(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    queue: str,
) -> None:
    http = serve(make_app(generation_queue=None, embedding_queue=None))
    assert http.get("/v1/models").json() == {"object": "list", "data": []}
    response = http.post("/v1/completions", json={"model": "m", "prompt": "x"})
    message = assert_error(response, 404, code="queue_not_configured")["message"]
    assert "BATCHLINE_GENERATION_QUEUE" in message
    response = http.post("/v1/embeddings", json={"model": queue, "input": "x"})
    assert "embedding_queue" in assert_error(response, 404)["message"]
    # The app's own routes are still there, and the /v1 routes' own OpenAPI document.
    assert http.get("/healthz").status_code == 200
    paths = http.get("/v1/openapi.json").json()["paths"]
    assert {"/embeddings", "/completions", "/chat/completions", "/models"} <= set(paths)


def test_a_full_queue_is_429_and_no_answer_in_time_is_504_and_cancelled(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    redis_url: str,
    gen_queue: str,
    rclient: redis.Redis,
) -> None:
    # No worker: what is queued stays queued.
    http = serve(make_app(timeout_s=None, request_timeout_s=0.5, max_queue_depth=2))
    body = {"model": gen_queue, "prompt": "x"}
    response = http.post("/v1/completions", json=body)
    error = assert_error(response, 504, type="timeout_error")
    assert f"on queue {gen_queue!r}: no live worker serves that queue" in error["message"]
    assert "BATCHLINE_REDIS_URL" not in error["message"], error  # no Redis URL to a client
    keys = QueueKeys(gen_queue)
    assert len(cancelled_ids(rclient, keys)) == 1  # nobody waits for it any more
    with Producer(redis_url=redis_url, queue=gen_queue) as producer:
        producer.submit("fills the queue", reply=False)
    response = http.post("/v1/completions", json=body)
    assert_error(response, 429, code="queue_full")
    assert response.headers["retry-after"] == "1"
    # a stored response is stored as failed, and answered as the error it was
    response = http.post("/v1/responses", json={"model": gen_queue, "input": "x"})
    assert_error(response, 429, type="rate_limit_error", code="queue_full")
    assert response.headers["retry-after"] == "1"


@contextlib.contextmanager
def posted(http: httpx.Client, path: str, body: bytes) -> Iterator[socket.socket]:
    """Send a POST on a socket of its own; hang up (without reading) on leaving."""
    host, port = http.base_url.host, http.base_url.port
    assert port is not None
    with socket.create_connection((host, port)) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        yield sock


def read_events(sock: socket.socket, n: int) -> bytes:
    """Read an answer from ``sock`` until it holds ``n`` server-sent events."""
    received = b""
    while received.count(b"data: ") < n:
        data = sock.recv(65536)
        assert data, f"the answer ended: {received!r}"
        received += data
    assert b" 200 OK" in received.split(b"\r\n", 1)[0]
    return received


HangUp = Callable[[str, dict[str, Any], int], tuple[str, bytes]]


@pytest.fixture
def hang_up(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    gen_queue: str,
    rclient: redis.Redis,
    gate: Any,
) -> HangUp:
    """``hang_up(path, body, events)``: POST a generation of 200 tokens to a gated worker,
    hang up once ``events`` events came (0: once it runs), check that the app cancelled it
    and that its worker ended it early; the request's id, and what the client received."""

    def run(path: str, body: dict[str, Any], events: int) -> tuple[str, bytes]:
        start_worker("generate", model_path=spec("tiny_llama_gated"), queue=gen_queue)
        http = serve(make_app())
        received = b""
        with posted(http, path, json.dumps(body).encode()) as sock:
            gate.allow(4)  # the prefill and three decode steps
            if events:
                received = read_events(sock, events)
            else:
                gate.wait_passes(4)  # it runs
        cancels = wait_until(
            lambda: rclient.xrange(QueueKeys(gen_queue).cancels), "the app to cancel the request"
        )
        request_id = cancels[0][1][b"id"].decode()
        gate.open()
        with Producer(redis_url=redis_url, queue=gen_queue) as producer:
            result = poll(producer, request_id)
        assert result.status == "ok"
        assert result.output["finish_reason"] == "cancelled"
        assert result.output["tokens"] < 200
        return request_id, received

    return run


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.slow
def test_a_client_that_hangs_up_cancels_its_request(
    hang_up: HangUp, gen_queue: str, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": gen_queue, "messages": CHAT, "max_tokens": 200, "stream": stream}
    server_log = logging.getLogger("uvicorn.error")  # (uvicorn's loggers do not propagate)
    server_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO):
            request_id, received = hang_up("/v1/chat/completions", body, 2 if stream else 0)
    finally:
        server_log.removeHandler(caplog.handler)
    if stream:
        assert request_id.encode() in received  # the chunks' id is the request's
    # A client going is no failure of the app: no error line, no traceback.
    failed = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not failed, [r.getMessage() for r in failed]


# -- streaming ------------------------------------------------------------------------------------


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream, in order."""
    assert response.status_code == 200, response.read()
    assert response.headers["content-type"].startswith("text/event-stream")
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.slow
def test_streamed_chat_with_the_openai_client(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    workers: Callable[..., None],
    gen_queue: str,
    reference: Any,  # noqa: F811
) -> None:
    workers()
    client = client_for(serve(make_app()))
    want = in_process(reference, {"messages": CHAT, "max_new_tokens": 14})

    chunks = list(
        client.chat.completions.create(
            model=gen_queue,
            messages=CHAT,
            max_tokens=14,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *with_choices, last = chunks
    assert with_choices[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content or "" for c in with_choices]
    assert "".join(texts) == want.text
    reasons = [c.choices[0].finish_reason for c in with_choices]
    assert reasons[:-1] == [None] * (len(reasons) - 1)
    assert reasons[-1] == ("length" if want.finish_reason == "length" else "stop")
    assert len({c.id for c in chunks}) == 1
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert all(c.usage is None for c in with_choices)
    assert last.choices == []
    assert last.usage.prompt_tokens == want.prompt_tokens
    assert last.usage.completion_tokens == len(want.token_ids)


@pytest.mark.slow
def test_a_streamed_completion_read_as_raw_events(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    workers: Callable[..., None],
    gen_queue: str,
    reference: Any,  # noqa: F811
) -> None:
    workers(max_new_tokens_limit=50)
    http = serve(make_app())
    body = {"model": gen_queue, "prompt": "Once upon a time", "max_tokens": 20, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    want = in_process(reference, {"prompt": "Once upon a time", "max_new_tokens": 20})
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)

    # What fails before the first chunk is an HTTP error, not a stream.
    response = http.post("/v1/completions", json={**body, "max_tokens": 51})
    assert_error(response, 400, code="BadGenerationParams")


def test_a_stream_with_no_answer_in_time_is_504_and_cancelled(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    gen_queue: str,
    rclient: redis.Redis,
) -> None:
    http = serve(make_app(timeout_s=0.5))  # and no worker
    body = {"model": gen_queue, "messages": CHAT, "stream": True}
    error = assert_error(http.post("/v1/chat/completions", json=body), 504, type="timeout_error")
    assert error["message"].startswith("no new text within 0.5 s on queue"), error
    assert "no live worker serves that queue" in error["message"], error
    assert "BATCHLINE_REDIS_URL" not in error["message"], error  # no Redis URL to a client
    cancels = wait_until(lambda: cancelled_ids(rclient, QueueKeys(gen_queue)), "the cancel")
    assert len(cancels) == 1


@pytest.mark.slow
def test_a_stream_that_stalls_ends_with_an_error_event_and_is_cancelled(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,
    rclient: redis.Redis,
    gate: Any,
) -> None:
    # A stall longer than the app's timeout and shorter than the worker's bound (the derived
    # bound would take the stalled step for a hang after 5 s).
    start_worker(
        "generate", model_path=spec("tiny_llama_gated"), queue=gen_queue, max_batch_ms=60_000
    )
    http = serve(make_app(timeout_s=8))  # ample for the first steps, then the model stalls
    gate.allow(3)  # the prefill and two decode steps, then no more
    body = {"model": gen_queue, "prompt": "abc", "max_tokens": 200, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = sse_events(response)
    *chunks, last = [json.loads(e) for e in events]  # no [DONE]
    assert chunks
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert last["error"]["type"] == "timeout_error"
    cancels = wait_until(lambda: rclient.xrange(QueueKeys(gen_queue).cancels), "the cancel")
    assert chunks[0]["id"] == f"cmpl-{cancels[0][1][b'id'].decode()}"
