"""The OpenAI Batch API (``/v1/files``, ``/v1/batches``) end to end: the official ``openai``
client over uvicorn, the session's redis-server, and real workers (threads of this process:
``batch_models.counting_embed``, which counts each text it computes, and the tiny random
Llama). Each test has its own key prefix, so that no other test's batches are in sight."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from fastapi import FastAPI
from pydantic import SecretStr

from batchline.acl import acl_rules
from batchline.config import WebSettings
from batchline.contrib.batches import _run as _batch_run
from batchline.contrib.batches._process import CHILD
from batchline.contrib.fastapi import create_app
from batchline.keys import BatchApiKeys, QueueKeys

from ..openai.test_openai import client_for
from ..test_fastapi import Serve, serve
from tests.support import batch_models
from tests.support.scale_security import named_acl_users
from tests.support.schemas import DEFS_SCHEMAS, HUGE_PATTERN, SEED, json_schema, json_schema_format
from tests.support.service import (
    RESULT_TIMEOUT_S,
    START_TIMEOUT_S,
    WorkerThread,
    spec,
    stop_all,
    subprocess_env,
    wait_until,
)
from tests.support.web_models import vector
from tests.worker.test_generate import CHAT, TINY

openai = pytest.importorskip("openai")

__all__ = ["serve"]  # a fixture, used here

COUNTING = f"{batch_models.__name__}:counting_embed"
MakeApp = Callable[..., FastAPI]


@pytest.fixture
def make_app(redis_url: str, queue: str) -> MakeApp:
    """``make_app(**settings)``: the app, its embedding queue ``queue``, its keys under the
    prefix ``queue`` (this test's alone)."""

    def make(**settings: Any) -> FastAPI:
        settings.setdefault("embedding_queue", queue)
        settings.setdefault("batch_lease_s", 2.0)
        return create_app(
            WebSettings(redis_url=SecretStr(redis_url), queue=queue, prefix=queue, **settings),
            timeout_s=RESULT_TIMEOUT_S,
        )

    return make


@pytest.fixture
def embedder(start_worker: Callable[..., WorkerThread], queue: str) -> Iterator[None]:
    """An embedding worker counting its calls (batch_models.CALLS, reset here)."""
    batch_models.reset()
    start_worker(COUNTING, prefix=queue)
    yield
    batch_models.GATE.set()


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def embedding_line(custom_id: str, text: str, model: str) -> dict[str, Any]:
    body = {"model": model, "input": text, "encoding_format": "float"}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}


def upload(client: Any, data: bytes) -> Any:
    return client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")


def finished(client: Any, batch_id: str) -> Any:
    """The batch, once in a final status."""
    found: list[Any] = []

    def done() -> bool:
        found[:] = [client.batches.retrieve(batch_id)]
        return found[0].status in ("completed", "failed", "cancelled", "expired")

    wait_until(done, f"batch {batch_id} to finish", timeout_s=RESULT_TIMEOUT_S)
    return found[0]


def embeddings_batch(client: Any, lines: list[Any]) -> Any:
    """A batch of ``lines`` (embeddings) created: its file uploaded, the batch made."""
    return client.batches.create(
        input_file_id=upload(client, jsonl(lines)).id,
        endpoint="/v1/embeddings",
        completion_window="24h",
    )


def answered_part(client: Any, lines: list[Any], answered: int) -> Any:
    """A batch of ``lines`` created, once ``answered`` of them are answered (the model held)."""
    batch = embeddings_batch(client, lines)
    wait_until(
        lambda: client.batches.retrieve(batch.id).request_counts.completed == answered,
        f"{answered} lines answered",
    )
    return batch


def file_lines(client: Any, file_id: str | None) -> dict[str, dict[str, Any]]:
    """A file's lines by custom_id (every custom_id once)."""
    if file_id is None:
        return {}
    lines = [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id answered twice"
    return by_id


@pytest.mark.slow
@pytest.mark.parametrize("driver", ["process", "loop"])
def test_an_embeddings_batch_answers_every_line_once(
    make_app: MakeApp,
    serve: Serve,
    embedder: None,
    queue: str,  # noqa: F811
    driver: str,
) -> None:
    client = client_for(serve(make_app(batch_driver=driver)))
    texts = [f"text number {i}" for i in range(40)]
    lines: list[Any] = [embedding_line(f"req-{i}", t, queue) for i, t in enumerate(texts)]
    lines += [
        b'{"custom_id": "broken", "method": "POST"',  # not JSON
        {**embedding_line("elsewhere", "x", queue), "url": "/v1/moderations"},
        {**embedding_line("refused", "z", queue), "body": {"model": queue, "input": "z", "n": 2}},
        embedding_line("no-model", "y", "not-a-model"),
    ]
    file = upload(client, jsonl(lines))
    assert (file.purpose, file.bytes, file.object) == ("batch", len(jsonl(lines)), "file")
    assert client.files.retrieve(file.id).filename == "batch.jsonl"
    assert client.files.content(file.id).content == jsonl(lines)

    batch = client.batches.create(
        input_file_id=file.id,
        endpoint="/v1/embeddings",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status in ("validating", "in_progress")
    batch = finished(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.metadata == {"job": "nightly"}
    assert (batch.request_counts.total, batch.request_counts.completed) == (44, 40)
    assert batch.request_counts.failed == 4
    assert batch.in_progress_at
    assert batch.finalizing_at
    assert batch.completed_at

    out = file_lines(client, batch.output_file_id)
    assert sorted(out) == sorted(f"req-{i}" for i in range(40))
    for i, text in enumerate(texts):
        response = out[f"req-{i}"]["response"]
        assert response["status_code"] == 200
        assert response["body"]["data"][0]["embedding"] == vector(text)
        assert response["body"]["model"] == queue
    errors = file_lines(client, batch.error_file_id)
    assert errors[None]["error"]["code"] == "invalid_json_line"
    assert errors["elsewhere"]["error"]["code"] == "invalid_url"
    assert errors["refused"]["response"]["status_code"] == 400  # as the route answers it
    assert errors["refused"]["response"]["body"]["error"]["param"] == "n"
    assert errors["no-model"]["response"]["status_code"] == 404
    assert errors["no-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert {t: 1 for t in texts} == batch_models.CALLS  # each computed once

    listed = client.batches.list(limit=10)
    assert [b.id for b in listed.data] == [batch.id]
    assert client.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file.id)


def test_bad_files_and_unknown_ids_fail_as_openai_does(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    queue: str,
) -> None:
    client = client_for(serve(make_app(max_file_bytes=4096)))

    def create(file_id: str) -> Any:
        return client.batches.create(
            input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
        )

    empty = create(upload(client, b"\n").id)
    assert (empty.status, empty.errors.data[0].code) == ("failed", "empty_file")
    assert empty.failed_at is not None
    twice = jsonl([embedding_line("same", "a", queue), embedding_line("same", "b", queue)])
    dup = create(upload(client, twice).id)
    assert (dup.status, dup.errors.data[0].code) == ("failed", "duplicate_custom_id")
    assert client.batches.retrieve(dup.id).status == "failed"

    with pytest.raises(openai.BadRequestError) as caught:  # not a purpose kept here
        client.files.create(file=("x.jsonl", io.BytesIO(twice)), purpose="fine-tune")
    assert caught.value.body["param"] == "purpose"
    with pytest.raises(openai.APIStatusError) as too_big:
        upload(client, b"x" * 5000)
    assert too_big.value.status_code == 413
    with pytest.raises(openai.BadRequestError):  # an endpoint OpenAI's batches do not run
        client.batches.create(
            input_file_id=dup.input_file_id,
            endpoint="/v1/moderations",  # type: ignore[arg-type]
            completion_window="24h",
        )

    calls: list[Callable[[], Any]] = [lambda: create("file-unknown")]
    for unknown in ("unknown", "not an id!", "x" * 129):  # (the last two: no id's shape)
        calls += [
            lambda u=unknown: client.batches.retrieve(f"batch_{u}"),
            lambda u=unknown: client.batches.cancel(f"batch_{u}"),
            lambda u=unknown: client.files.retrieve(f"file-{u}"),
            lambda u=unknown: client.files.content(f"file-{u}"),
            lambda u=unknown: client.files.delete(f"file-{u}"),
        ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        error = missing.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "not_found"
    with pytest.raises(openai.ConflictError):  # a finished batch is not cancelled
        client.batches.cancel(dup.id)
    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [dup.id]
    assert page.has_more
    assert [b.id for b in client.batches.list(after=dup.id).data] == [empty.id]


@pytest.mark.slow
def test_a_batch_created_twice_computes_nothing_twice(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    embedder: None,
    queue: str,
) -> None:
    client = client_for(serve(make_app(batch_window=8)))
    texts = [f"again {i}" for i in range(24)]
    file = upload(client, jsonl([embedding_line(f"r{i}", t, queue) for i, t in enumerate(texts)]))
    ids = [
        client.batches.create(
            input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"
        ).id
        for _ in range(2)  # a client retrying its create
    ]
    outputs = [file_lines(client, finished(client, i).output_file_id) for i in ids]
    assert outputs[0].keys() == outputs[1].keys() == {f"r{i}" for i in range(24)}
    assert {t: 1 for t in texts} == batch_models.CALLS


@pytest.mark.slow
def test_cancel_stops_the_queued_lines_and_keeps_the_answered_ones(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    queue: str,
) -> None:
    batch_models.reset(hold_after=5)
    start_worker(COUNTING, prefix=queue, batch_size=1, max_batch_ms=60_000)
    try:
        client = client_for(serve(make_app(batch_window=4)))
        lines = [embedding_line(f"c{i}", f"cancel me {i}", queue) for i in range(20)]
        batch = answered_part(client, lines, 5)
        assert client.batches.cancel(batch.id).status == "cancelling"
    finally:
        batch_models.GATE.set()
    done = finished(client, batch.id)
    assert done.status == "cancelled"
    assert done.cancelled_at is not None
    counts = done.request_counts
    assert counts.completed >= 5
    assert counts.completed + counts.failed == 20
    out = file_lines(client, done.output_file_id)
    errors = file_lines(client, done.error_file_id)
    assert len(out) == counts.completed
    assert len(errors) == counts.failed
    assert not out.keys() & errors.keys()
    assert {e["error"]["code"] for e in errors.values()} == {"cancelled"}
    assert set(batch_models.CALLS.values()) == {1}
    # Only the lines in the queue (the window) when the cancel came ran after it.
    assert len(batch_models.CALLS) <= counts.completed + 4


@pytest.mark.slow
def test_a_batch_whose_input_file_is_deleted_fails(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    queue: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_batch_run, "CHUNK_LINES", 4)  # the file is read 4 lines at a time
    batch_models.reset(hold_after=2)
    start_worker(COUNTING, prefix=queue, batch_size=1, max_batch_ms=60_000)
    try:  # (the driver on the app's loop: a child process would not see the patch)
        client = client_for(serve(make_app(batch_window=2, batch_driver="loop")))
        lines = [embedding_line(f"d{i}", f"deleted {i}", queue) for i in range(12)]
        batch = answered_part(client, lines, 2)
        client.files.delete(batch.input_file_id)
    finally:
        batch_models.GATE.set()
    done = finished(client, batch.id)
    assert (done.status, done.errors.data[0].code) == ("failed", "input_file_deleted")
    counts = done.request_counts
    assert counts.completed >= 2  # (answered before the file went)
    out = file_lines(client, done.output_file_id)  # kept, as by a batch that ends otherwise
    assert len(out) == counts.completed
    assert out.keys() <= {f"d{i}" for i in range(12)}
    assert (counts.failed, done.error_file_id) == (0, None)
    assert [f.id for f in client.files.list(purpose="batch_output")] == [done.output_file_id]


@pytest.mark.slow
def test_a_replica_with_the_driver_off_leaves_its_batches_to_one_with_it_on(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    embedder: None,
    queue: str,
) -> None:
    front = client_for(serve(make_app(batch_driver="off", batch_lease_s=0.2)))
    lines = [embedding_line(f"o{i}", f"off {i}", queue) for i in range(8)]
    batch = front.batches.create(
        input_file_id=upload(front, jsonl(lines)).id,
        endpoint="/v1/embeddings",
        completion_window="24h",
    )
    time.sleep(1.0)  # five looks of a driver, had this replica one
    assert front.batches.retrieve(batch.id).status == "validating"
    serve(make_app(batch_lease_s=0.2))  # a replica that drives batches
    done = finished(front, batch.id)
    assert (done.status, done.request_counts.completed) == ("completed", 8)


@pytest.mark.slow
def test_a_driver_process_that_dies_is_started_again(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    embedder: None,
    queue: str,
) -> None:
    client = client_for(serve(make_app()))
    first = wait_until(drivers, "the driver's process to start")
    os.kill(first[0], signal.SIGKILL)
    wait_until(lambda: bool(set(drivers()) - set(first)), "another driver process")
    lines = [embedding_line(f"a{i}", f"again {i}", queue) for i in range(4)]
    done = finished(client, embeddings_batch(client, lines).id)
    assert (done.status, done.request_counts.completed) == ("completed", 4)


def drivers() -> list[int]:
    """The batch driver processes this process runs."""
    return [
        pid
        for pid in children_of(os.getpid())
        if alive(pid) and CHILD.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


@pytest.mark.slow
def test_an_api_killed_mid_batch_resumes_it_once_restarted(
    redis_url: str, start_worker: Callable[..., WorkerThread], queue: str
) -> None:
    batch_models.reset(hold_after=10)
    start_worker(COUNTING, prefix=queue, batch_size=1, max_batch_ms=60_000)
    env = {
        "BATCHLINE_REDIS_URL": redis_url,
        "BATCHLINE_QUEUE": queue,
        "BATCHLINE_PREFIX": queue,
        "BATCHLINE_EMBEDDING_QUEUE": queue,
        "BATCHLINE_BATCH_LEASE_S": "1",
        "BATCHLINE_BATCH_WINDOW": "4",
    }
    try:
        with api_process(env) as http:
            client = client_for(http)
            texts = [f"survive {i}" for i in range(30)]
            lines = [embedding_line(f"k{i}", t, queue) for i, t in enumerate(texts)]
            batch = answered_part(client, lines, 10)
    finally:
        batch_models.GATE.set()  # the lines in the queue are answered while no API runs
    with api_process(env) as http:
        done = finished(client_for(http), batch.id)
        assert (done.status, done.request_counts.completed) == ("completed", 30)
        out = file_lines(client_for(http), done.output_file_id)
    assert out.keys() == {f"k{i}" for i in range(30)}
    assert {t: 1 for t in texts} == batch_models.CALLS


@contextlib.contextmanager
def api_process(env: dict[str, str], *options: str) -> Iterator[httpx.Client]:
    """The app under uvicorn (with these ``options`` of its) in a process of its own;
    SIGKILLed on leaving."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "uvicorn", "batchline.contrib.fastapi:create_app"]
    command += ["--factory", "--port", str(port), "--log-level", "warning", *options]
    proc = subprocess.Popen(command, env=subprocess_env(env))
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=RESULT_TIMEOUT_S)

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the API exited with {proc.returncode}")
        try:
            return http.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(up, "the API to start", timeout_s=START_TIMEOUT_S)
        yield http
    finally:
        http.close()
        children = children_of(proc.pid)  # its batch driver's process
        proc.send_signal(signal.SIGKILL)
        proc.wait(START_TIMEOUT_S)
        wait_until(lambda: not any(map(alive, children)), "the API's children to exit")


def children_of(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux's /proc)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(x) for x in (task / "children").read_text().split()]
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, its parent gone and not reaped, does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.slow
def test_chat_and_completion_batches_answer_as_the_routes_do(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    queue: str,
) -> None:
    gen_queue = f"{queue}-gen"
    start_worker(
        "generate", model_path=TINY, queue=gen_queue, prefix=queue, default_max_new_tokens=8
    )
    client = client_for(serve(make_app(embedding_queue=None, generation_queue=gen_queue)))
    chat = {"model": gen_queue, "messages": CHAT, "max_tokens": 6}
    completion = {"model": gen_queue, "prompt": "Once upon a time", "max_tokens": 5}
    for endpoint, body, streamed in (
        ("/v1/chat/completions", chat, {**chat, "stream": True}),
        ("/v1/completions", completion, {**completion, "stream": True}),
    ):
        unusable = {**body, "response_format": json_schema(HUGE_PATTERN)}  # as the route checks
        lines = [
            {"custom_id": "one", "method": "POST", "url": endpoint, "body": body},
            {"custom_id": "streamed", "method": "POST", "url": endpoint, "body": streamed},
            {"custom_id": "unusable", "method": "POST", "url": endpoint, "body": unusable},
        ]
        batch = client.batches.create(
            input_file_id=upload(client, jsonl(lines)).id,
            endpoint=endpoint,  # type: ignore[arg-type]
            completion_window="24h",
        )
        done = finished(client, batch.id)
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == (
            "completed",
            1,
            2,
        )
        got = file_lines(client, done.output_file_id)["one"]["response"]["body"]
        direct = client.post(endpoint.removeprefix("/v1"), body=body, cast_to=httpx.Response).json()
        for answer in (got, direct):  # the ids and times differ
            del answer["id"], answer["created"]
        assert got == direct
        errors = file_lines(client, done.error_file_id)
        refused = errors["streamed"]["response"]
        assert (refused["status_code"], refused["body"]["error"]["param"]) == (400, "stream")
        refused = errors["unusable"]["response"]
        assert (refused["status_code"], refused["body"]["error"]["param"]) == (
            400,
            "response_format",
        )


@pytest.mark.slow
def test_defs_schemas_run_and_a_line_nested_too_deep_is_that_lines_error(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    queue: str,
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    gen_queue = f"{queue}-gen"
    start_worker("generate", model_path=spec("tiny_llama_chars"), queue=gen_queue, prefix=queue)
    client = client_for(serve(make_app(embedding_queue=None, generation_queue=gen_queue)))
    endpoint = "/v1/chat/completions"

    def chat(custom_id: str, **body: Any) -> dict[str, Any]:
        body = {"model": gen_queue, "messages": CHAT, "max_tokens": 200, **body}
        return {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body}

    sampled = {"temperature": 1.0, "seed": SEED}
    lines: list[Any] = [
        chat(name, response_format=json_schema_format(name), **sampled) for name in DEFS_SCHEMAS
    ]
    lines.append(b"[" * 50_000 + b"]" * 50_000)  # one line of the file: its own error
    deep = chat("deep", response_format=json_schema_format("recursive"))
    schema = deep["body"]["response_format"]["json_schema"]["schema"]
    for _ in range(60):
        schema = {"type": "array", "items": schema}
    deep["body"]["response_format"]["json_schema"]["schema"] = schema
    lines.append(deep)  # its line is too deep too, though its custom_id is readable
    file = upload(client, jsonl(lines))  # no 500: the upload only counts the lines
    batch = client.batches.create(
        input_file_id=file.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
    )
    done = finished(client, batch.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == (
        "completed",
        len(DEFS_SCHEMAS),
        2,
    )
    out = file_lines(client, done.output_file_id)
    for name, want in DEFS_SCHEMAS.items():
        choice = out[name]["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", (name, choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), want)
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert [e["error"]["code"] for e in errors] == ["invalid_json_line"] * 2
    assert all("MAX_JSON_DEPTH=64" in e["error"]["message"] for e in errors)


@pytest.mark.slow
def test_a_batch_runs_under_the_acl_users_batchline_acl_prints(
    redis_url: str,
    serve: Serve,
    start_worker: Callable[..., WorkerThread],
    queue: str,  # noqa: F811
) -> None:
    """The backend under the producer user with ``--batch-api``'s rules, the worker under the
    worker user: a batch completes; the plain producer user may not touch a batch's keys."""
    keys = QueueKeys(queue, prefix=queue)
    rules = {
        "api": acl_rules(keys, "producer", batch_api=True),
        "plain": acl_rules(keys, "producer"),
        "worker": acl_rules(keys, "worker"),
    }
    with named_acl_users(redis_url, queue[-8:], rules) as urls:
        batch_models.reset()
        worker = start_worker(COUNTING, prefix=queue, redis_url=urls["worker"])
        try:
            _a_batch_under_the_users(serve, urls, queue)
        finally:
            batch_models.GATE.set()
            stop_all([worker])  # before its user goes


def _a_batch_under_the_users(serve: Serve, urls: dict[str, str], queue: str) -> None:
    """A batch completed by the app under the ``api`` user; the ``plain`` user may not
    read its keys."""
    app = create_app(
        WebSettings(
            redis_url=SecretStr(urls["api"]),
            queue=queue,
            prefix=queue,
            embedding_queue=queue,
            batch_lease_s=2.0,
        ),
        timeout_s=RESULT_TIMEOUT_S,
    )
    client = client_for(serve(app))
    lines = [embedding_line(f"r{i}", f"acl text {i}", queue) for i in range(5)]
    batch = client.batches.create(
        input_file_id=upload(client, jsonl(lines)).id,
        endpoint="/v1/embeddings",
        completion_window="24h",
    )
    done = finished(client, batch.id)
    assert (done.status, done.request_counts.completed) == ("completed", 5)
    plain = redis.Redis.from_url(urls["plain"])
    with pytest.raises(redis.exceptions.NoPermissionError):
        plain.hgetall(BatchApiKeys(queue).batch(batch.id))
    plain.close()


@pytest.mark.slow
def test_files_list_in_pages_in_either_order_and_expire_when_asked(
    make_app: MakeApp,
    serve: Serve,
    redis_url: str,
    queue: str,  # noqa: F811
) -> None:
    client = client_for(serve(make_app()))
    line = jsonl([embedding_line("a", "x", queue)])
    ids = [upload(client, line).id for _ in range(5)]  # created within a second or two
    newest_first = [f.id for f in client.files.list(limit=2)]  # the client follows after
    assert sorted(newest_first) == sorted(ids)
    page = client.files.list(limit=2)
    assert (len(page.data), page.has_more) == (2, True)
    assert [f.id for f in client.files.list(order="asc")] == newest_first[::-1]
    assert [f.id for f in client.files.list(purpose="batch_output")] == []

    kept = client.files.create(
        file=("e.jsonl", io.BytesIO(line)),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert kept.expires_at == kept.created_at + 3600
    admin = redis.Redis.from_url(redis_url)
    keys = BatchApiKeys(queue)
    assert 3500 < admin.ttl(keys.file(kept.id)) <= 3600
    assert 3500 < admin.ttl(keys.lines(kept.id)) <= 3600
    assert client.files.retrieve(ids[0]).expires_at is None
    admin.delete(keys.file(kept.id), keys.lines(kept.id))  # as when it expires
    assert kept.id not in [f.id for f in client.files.list()]
    assert admin.zscore(keys.files, kept.id) is None  # the list forgets it
    admin.close()
    for expires, name in [
        ({"anchor": "created_at", "seconds": 60}, "seconds"),
        ({"anchor": "last_used", "seconds": 3600}, "anchor"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.create(
                file=("e.jsonl", io.BytesIO(line)), purpose="batch", expires_after=expires
            )
        assert refused.value.param == "expires_after"
        assert name in str(refused.value)
    with pytest.raises(openai.BadRequestError):
        client.files.list(limit=0)
