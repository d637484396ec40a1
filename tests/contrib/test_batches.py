"""The OpenAI Batch API (``/v1/files``, ``/v1/batches``) end to end: the official ``openai``
client over uvicorn, the session's redis-server, and real workers (threads of this process:
``batch_models.counting_embed``, which counts each text it computes, and the tiny random
Llama). Each test has its own key prefix, so that no other test's batches are in sight."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from batchline.config import WebSettings
from batchline.contrib.fastapi import create_app

from .test_fastapi import Serve, serve
from .test_openai import client_for
from tests.support import batch_models
from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, wait_until
from tests.support.web_models import vector

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


def file_lines(client: Any, file_id: str | None) -> dict[str, dict[str, Any]]:
    """A file's lines by custom_id (every custom_id once)."""
    if file_id is None:
        return {}
    lines = [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id answered twice"
    return by_id


@pytest.mark.slow
def test_an_embeddings_batch_answers_every_line_once(
    make_app: MakeApp,
    serve: Serve,
    embedder: None,
    queue: str,  # noqa: F811
) -> None:
    client = client_for(serve(make_app()))
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
