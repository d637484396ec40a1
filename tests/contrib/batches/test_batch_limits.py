"""The Batch API's output bounds, end to end (test_batches' app, client and workers): a
batch of large answers completes under a short lease; answers over the output limits are
their lines' errors and the batch goes on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ..openai.test_openai import client_for
from ..test_fastapi import Serve, serve
from .test_batches import (
    MakeApp,
    embedder,
    embedding_line,
    file_lines,
    finished,
    jsonl,
    make_app,
    upload,
)
from tests.support import batch_models
from tests.support.service import WorkerThread

pytest.importorskip("openai")

__all__ = ["embedder", "make_app", "serve"]  # fixtures, used here

WIDE = f"{batch_models.__name__}:wide_embed"


def wide_line(custom_id: str, texts: int, model: str) -> dict[str, Any]:
    body = {"model": model, "input": [f"text {i} of a line of many" for i in range(texts)]}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}


def create(client: Any, lines: list[Any]) -> Any:
    return client.batches.create(
        input_file_id=upload(client, jsonl(lines)).id,
        endpoint="/v1/embeddings",
        completion_window="24h",
    )


@pytest.mark.slow
def test_a_batch_of_large_answers_completes_under_a_short_lease(
    make_app: MakeApp, serve: Serve, start_worker: Callable[..., WorkerThread], queue: str
) -> None:
    """A large line's answer (2048 vectors of 768 float32, 30 MB as JSON) takes its driver
    longer to encode than the batch's lease (0.5 s) lasts without renewal: encoded in one
    go, on the loop that renews it, the lease would lapse on every try."""
    start_worker(WIDE, prefix=queue)
    client = client_for(serve(make_app(batch_lease_s=0.5)))  # (the driver in its process)
    lines = [wide_line("big-0", 2048, queue), wide_line("big-1", 2048, queue)]
    lines.append(embedding_line("small", "x", queue))
    done = finished(client, create(client, lines).id)
    counts = done.request_counts
    assert (done.status, counts.completed, counts.failed) == ("completed", 3, 0), done
    out = file_lines(client, done.output_file_id)
    third = float(np.float32(1 / 3))
    for custom_id, texts in (("big-0", 2048), ("big-1", 2048), ("small", 1)):
        data = out[custom_id]["response"]["body"]["data"]
        assert [d["index"] for d in data] == list(range(texts))
        assert data[-1]["embedding"] == [third] * batch_models.WIDE_DIM
    client.files.delete(done.output_file_id)  # (60 MB of the session's Redis)


@pytest.mark.slow
def test_answers_over_the_output_limits_are_their_lines_errors_and_the_batch_goes_on(
    make_app: MakeApp, serve: Serve, embedder: None, queue: str
) -> None:
    cap = 4096
    # One line at a time (a window of 1): the lines run, and fill the output, in order.
    app = make_app(batch_window=1, batch_max_answer_bytes=2048, batch_max_output_bytes=cap)
    client = client_for(serve(app))
    lines = [embedding_line(f"a{i}", f"first {i}", queue) for i in range(3)]
    lines.append(wide_line("wide", 40, queue))  # an answer of about 3 KB
    lines += [embedding_line(f"b{i}", f"then {i}", queue) for i in range(30)]
    done = finished(client, create(client, lines).id)
    assert done.status == "completed"
    out = file_lines(client, done.output_file_id)
    errors = {k: v["error"] for k, v in file_lines(client, done.error_file_id).items()}
    assert done.request_counts.completed == len(out)
    assert done.request_counts.failed == len(errors)
    wide = errors.pop("wide")
    assert wide["code"] == "answer_too_large"
    assert "max_answer_bytes=2048" in wide["message"]
    answered = [f"b{i}" for i in range(30) if f"b{i}" in out]
    assert {"a0", "a1", "a2"} <= out.keys()
    assert answered == [f"b{i}" for i in range(len(answered))]
    refused = [f"b{i}" for i in range(len(answered), 30)]
    assert sorted(errors) == sorted(refused)
    assert refused
    assert {e["code"] for e in errors.values()} == {"batch_output_limit"}
    assert "was left out" in errors[refused[0]]["message"]  # it ran; its answer did not fit
    assert all("not run" in errors[r]["message"] for r in refused[1:])
    assert f"limit of {cap} bytes" in errors[refused[0]]["message"]
    assert client.files.retrieve(done.output_file_id).bytes <= cap
    computed = set(batch_models.CALLS)
    assert {f"then {i}" for i in range(len(answered) + 1)} <= computed  # the refused one ran
    assert not computed & {f"then {i}" for i in range(len(answered) + 1, 30)}  # no others
