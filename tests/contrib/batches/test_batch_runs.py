"""How a batch's run ends, end to end (test_batches' app, client and workers): a line that
cannot run fails alone and the batch completes; cancelling a batch leaves another over the
same file its lines; a batch expires at its ``expires_at`` with no worker to say so; a
cancel accepted while a batch finishes wins."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import SecretStr

from batchline.contrib.batches import _routes as _batch_routes
from batchline.contrib.batches import _run as _batch_run
from batchline.producer import Producer

from ..openai.test_openai import client_for
from ..test_fastapi import Serve, serve
from .test_batches import (
    COUNTING,
    MakeApp,
    embedder,
    embedding_line,
    embeddings_batch,
    file_lines,
    finished,
    jsonl,
    make_app,
    upload,
)
from tests.support import batch_models
from tests.support.service import WorkerThread, wait_until

pytest.importorskip("openai")

__all__ = ["embedder", "make_app", "serve"]  # fixtures, used here


@pytest.mark.slow
def test_a_line_whose_custom_id_is_no_unicode_text_fails_alone(
    make_app: MakeApp, serve: Serve, embedder: None, queue: str
) -> None:
    """A lone surrogate escape is valid JSON, but no UTF-8 text: its line is refused (its
    error line names it), the other lines run, the batch completes."""
    client = client_for(serve(make_app(batch_lease_s=1.0)))
    lone = b'{"custom_id": "\\ud800", "method": "POST", "url": "/v1/embeddings", "body": {}}'
    lines: list[Any] = [embedding_line("ok-0", "text 0", queue), lone]
    lines.append(embedding_line("ok-1", "text 1", queue))
    done = finished(client, embeddings_batch(client, lines).id)
    counts = done.request_counts
    assert (done.status, counts.total, counts.completed, counts.failed) == ("completed", 3, 2, 1)
    assert file_lines(client, done.output_file_id).keys() == {"ok-0", "ok-1"}
    error = file_lines(client, done.error_file_id)["\ud800"]
    assert (error["response"], error["error"]["code"]) == (None, "invalid_custom_id")
    assert "lone surrogate" in error["error"]["message"]


@pytest.mark.slow
def test_cancelling_a_batch_leaves_another_over_the_same_file_its_lines(
    make_app: MakeApp,
    serve: Serve,
    start_worker: Callable[..., WorkerThread],
    queue: str,
) -> None:
    """Two batches over one file (a client that retried its create) share their lines'
    requests; cancelling one ends its own lines at once, and cancels in the queue none of
    the requests the other waits on: the other completes every line."""
    batch_models.reset(hold_after=2)
    start_worker(COUNTING, prefix=queue, batch_size=1, max_batch_ms=60_000)
    try:
        client = client_for(serve(make_app(batch_window=4)))
        file = upload(
            client, jsonl([embedding_line(f"s{i}", f"shared {i}", queue) for i in range(10)])
        )
        first, second = (
            client.batches.create(
                input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"
            )
            for _ in range(2)
        )
        for batch in (first, second):  # each waits on 4 requests, one of them held
            wait_until(
                lambda b=batch: client.batches.retrieve(b.id).request_counts.completed == 2,
                "2 lines answered",
            )
        assert client.batches.cancel(first.id).status == "cancelling"
        cancelled = finished(client, first.id)  # while the model is held
    finally:
        batch_models.GATE.set()
    assert cancelled.status == "cancelled"
    assert (cancelled.request_counts.completed, cancelled.request_counts.failed) == (2, 8)
    done = finished(client, second.id)
    assert (done.status, done.request_counts.completed, done.error_file_id) == (
        "completed",
        10,
        None,
    )
    assert file_lines(client, done.output_file_id).keys() == {f"s{i}" for i in range(10)}
    assert set(batch_models.CALLS.values()) == {1}


@pytest.mark.slow
@pytest.mark.parametrize("resumed", [False, True])
def test_a_batch_whose_lines_wait_in_the_queue_expires_at_its_expires_at_without_a_worker(
    make_app: MakeApp,
    serve: Serve,
    redis_url: str,
    queue: str,
    monkeypatch: pytest.MonkeyPatch,
    resumed: bool,
) -> None:
    """No worker serves the queue: the lines' requests wait there; at ``expires_at`` the
    driver itself ends them (``batch_expired``) and the batch ends ``expired``. ``resumed``:
    the driver fails once, every line answered, before it ends the batch; the run that
    resumes it, with no line left to run, ends it ``expired`` too (it is stored)."""
    monkeypatch.setattr(_batch_routes, "WINDOW_S", 4)  # (the driver on this loop sees it)
    finish = _batch_run.BatchRun._finish
    failed: list[str] = []

    async def fail_once(self: _batch_run.BatchRun) -> None:
        if not failed:
            failed.append(self.batch_id)
            raise RuntimeError("the driver failed before it ended the batch")
        await finish(self)

    if resumed:
        monkeypatch.setattr(_batch_run.BatchRun, "_finish", fail_once)
    client = client_for(serve(make_app(batch_driver="loop")))
    lines = [embedding_line(f"e{i}", f"expires {i}", queue) for i in range(3)]
    batch = embeddings_batch(client, lines)
    with Producer(redis_url=SecretStr(redis_url), queue=queue, prefix=queue) as producer:
        wait_until(lambda: producer.queue_depth() == 3, "the lines' requests queued")
    assert time.time() < batch.expires_at  # queued before it expired
    done = finished(client, batch.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == (
        "expired",
        0,
        3,
    )
    assert done.expired_at is not None
    assert done.output_file_id is None
    assert failed == ([batch.id] if resumed else [])
    errors = file_lines(client, done.error_file_id)
    assert errors.keys() == {"e0", "e1", "e2"}
    assert {e["error"]["code"] for e in errors.values()} == {"batch_expired"}


@pytest.mark.slow
def test_a_cancel_accepted_while_a_batch_finishes_ends_it_cancelled(
    make_app: MakeApp,
    serve: Serve,
    embedder: None,
    queue: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every line answered, the driver finishes the batch; a cancel the API accepts after
    the driver looked at the status, before its first write (the gap widened here: the
    cancel is made there), is not overwritten: the batch ends ``cancelled``."""
    client = client_for(serve(make_app(batch_driver="loop")))  # (it sees the patches)
    finish, guarded = _batch_run.BatchRun._finish, _batch_run.BatchRun.guarded
    finishing: set[str] = set()
    accepted: list[str] = []

    async def finish_watched(self: _batch_run.BatchRun) -> None:
        finishing.add(self.batch_id)
        await finish(self)

    async def guarded_after_a_cancel(self: _batch_run.BatchRun, write: Any, **how: Any) -> bool:
        if self.batch_id in finishing and not accepted:  # the finish's first write
            cancel = await asyncio.to_thread(client.batches.cancel, self.batch_id)
            accepted.append(cancel.status)
        return await guarded(self, write, **how)

    monkeypatch.setattr(_batch_run.BatchRun, "_finish", finish_watched)
    monkeypatch.setattr(_batch_run.BatchRun, "guarded", guarded_after_a_cancel)
    lines = [embedding_line(f"f{i}", f"finish {i}", queue) for i in range(3)]
    done = finished(client, embeddings_batch(client, lines).id)
    assert accepted == ["cancelling"]
    assert (done.status, done.request_counts.completed) == ("cancelled", 3)
    assert done.cancelling_at is not None
    assert done.cancelled_at is not None
    assert done.completed_at is None
    assert file_lines(client, done.output_file_id).keys() == {"f0", "f1", "f2"}
