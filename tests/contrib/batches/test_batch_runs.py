"""How a batch's run ends, end to end (test_batches' app, client and workers): a line that
cannot run fails alone and the batch completes."""

from __future__ import annotations

from typing import Any

import pytest

from ..openai.test_openai import client_for
from ..test_fastapi import Serve, serve
from .test_batches import (
    MakeApp,
    embedder,
    embedding_line,
    embeddings_batch,
    file_lines,
    finished,
    make_app,
)

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
