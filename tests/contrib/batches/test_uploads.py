"""Uploads (``POST /v1/files``), end to end (test_batches' app and client): an upload is
parsed off the API's event loop; one larger than ``max_body_bytes`` is taken; one refused
part way is answered (413) even while its client keeps sending, over a real socket (uvicorn
in a process of its own, httpx); the uploads under way share a budget (429)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from batchline.contrib.batches._lines import FileScan
from batchline.keys import BatchApiKeys

from ..openai.test_openai import client_for
from ..test_fastapi import Serve, serve
from .test_batches import MakeApp, api_process, embedding_line, jsonl, make_app, upload
from tests.support.service import START_TIMEOUT_S, wait_until

openai = pytest.importorskip("openai")

__all__ = ["make_app", "serve"]  # fixtures, used here

BOUNDARY = "b0undary"
FORM_HEAD = (
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="f.jsonl"\r\n\r\n'
).encode()
FORM_TYPE = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


def test_an_upload_is_parsed_off_the_apis_event_loop(
    make_app: MakeApp, serve: Serve, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While an upload's parse is held (its first line's check waits), the API answers."""
    http = serve(make_app())
    client = client_for(http)
    entered, release = threading.Event(), threading.Event()
    check = FileScan.add

    def held(self: FileScan, line: bytes) -> None:
        if not entered.is_set():
            entered.set()
            release.wait(START_TIMEOUT_S)
        check(self, line)

    monkeypatch.setattr(FileScan, "add", held)
    data = jsonl([embedding_line(f"p{i}", f"parsed {i}", queue) for i in range(100)])
    with ThreadPoolExecutor(1) as pool:
        try:
            uploading = pool.submit(upload, client, data)
            assert entered.wait(START_TIMEOUT_S), "the upload was never parsed"
            assert http.get("/healthz", timeout=5).status_code == 200
            assert [f.id for f in client.with_options(timeout=5).files.list()] == []
        finally:
            release.set()
        file = uploading.result()
    assert (file.bytes, client.files.content(file.id).content) == (len(data), data)


@pytest.mark.parametrize("name", ["upload", None])
def test_a_form_without_a_part_named_file_is_refused(
    make_app: MakeApp, serve: Serve, queue: str, name: str | None
) -> None:
    """A file part under another name is no file: 400 naming ``file``, as a form with no
    file part at all, never an empty file."""
    http = serve(make_app())
    data = jsonl([embedding_line("a", "x", queue)])
    form: dict[str, tuple[str | None, bytes]] = {"purpose": (None, b"batch")}
    if name is not None:
        form[name] = ("f.jsonl", data)
    refused = http.post("/v1/files", files=form)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "file"
    assert client_for(http).files.list().data == []


def test_an_upload_larger_than_max_body_bytes_is_taken_whatever_its_framing(
    make_app: MakeApp, serve: Serve, queue: str
) -> None:
    """``max_body_bytes`` bounds a request's body, not an upload's (``max_file_bytes``):
    the official client's upload, which declares its size, is taken as a chunked one is."""
    http = serve(make_app(max_body_bytes=64 << 10, max_file_bytes=1_000_000))
    client = client_for(http)
    data = jsonl([embedding_line(f"c{i}", f"content length {i}", queue) for i in range(2000)])
    assert len(data) > 4 * (64 << 10)
    file = upload(client, data)  # (Content-Length)
    assert client.files.content(file.id).content == data
    too_big = data * 4
    with pytest.raises(openai.APIStatusError) as refused:
        upload(client, too_big)
    assert refused.value.status_code == 413
    assert "max_file_bytes=1000000" in refused.value.message


class Body:
    """An upload's multipart body: ``total`` bytes of file in 64 KiB chunks, counting what
    was taken of it (``declared``: with its whole size, ``size``, as Content-Length)."""

    def __init__(self, total: int) -> None:
        self.line = b'{"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}\n'
        self.lines = total // len(self.line)
        self.end = f"\r\n--{BOUNDARY}--\r\n".encode()
        self.size = len(FORM_HEAD) + self.lines * len(self.line) + len(self.end)
        self.given = 0

    def __iter__(self) -> Iterator[bytes]:
        per = (64 << 10) // len(self.line)
        yield FORM_HEAD
        for start in range(0, self.lines, per):
            yield self.line * min(per, self.lines - start)
        yield self.end
        self.given = self.size  # (the server took it all)


@pytest.fixture
def small_files_api(redis_url: str, queue: str) -> Iterator[httpx.Client]:
    """The app under uvicorn in a process of its own, ``max_file_bytes`` 256 KiB."""
    env = {
        "BATCHLINE_REDIS_URL": redis_url,
        "BATCHLINE_QUEUE": queue,
        "BATCHLINE_PREFIX": queue,
        "BATCHLINE_MAX_FILE_BYTES": str(SMALL_FILES),
        "BATCHLINE_BATCH_DRIVER": "off",
    }
    with api_process(env) as http:
        yield http


SMALL_FILES = 256 << 10


@pytest.mark.slow
def test_an_upload_over_max_file_bytes_gets_its_413_while_its_client_keeps_sending(
    small_files_api: httpx.Client,
) -> None:
    """The API answers 413 once the file passes ``max_file_bytes``, its client sending
    8 MB more: the rest is read and dropped, then the connection closed (the client sees
    its answer, not a broken connection)."""
    body = Body(SMALL_FILES + (8 << 20))  # chunked
    response = small_files_api.post("/v1/files", content=body, headers=FORM_TYPE)
    assert response.status_code == 413, response.text
    assert response.headers["connection"] == "close"
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("file_too_large", "file")
    assert f"max_file_bytes={SMALL_FILES}" in error["message"]
    assert body.given == body.size


@pytest.mark.slow
def test_an_oversized_upload_that_declares_its_size_is_read_out_and_answered_413(
    small_files_api: httpx.Client,
) -> None:
    """An upload that declares 80 MB (more than any other request's refusal reads out:
    64 MiB) is answered 413 before any of it is read, then read to its end, so that a
    client that sends it whole before it reads (httpx, the official client) gets it."""
    body = Body(80 << 20)
    headers = {**FORM_TYPE, "Content-Length": str(body.size)}
    response = small_files_api.post("/v1/files", content=body, headers=headers)
    assert response.status_code == 413, response.text
    assert body.given == body.size  # it sent everything: nothing broke its connection
    assert f"{body.size} bytes (Content-Length)" in response.json()["error"]["message"]
    assert f"max_file_bytes={SMALL_FILES}" in response.json()["error"]["message"]


def test_uploads_under_way_share_a_budget_past_which_one_is_answered_429(
    make_app: MakeApp, serve: Serve, queue: str, redis_url: str
) -> None:
    http = serve(make_app(max_file_bytes=1_000_000, upload_budget_bytes=1_000_000))
    client = client_for(http)
    line = json.dumps(embedding_line("x" * 900, "budget", queue)).encode() + b"\n"  # ~1 KB
    held, release = threading.Event(), threading.Event()

    def first() -> Iterator[bytes]:
        yield FORM_HEAD + line * 700  # 700 KB received, then the client waits
        held.set()
        release.wait(START_TIMEOUT_S)
        yield f"\r\n--{BOUNDARY}--\r\n".encode()

    keys = BatchApiKeys(queue)
    admin = redis.Redis.from_url(redis_url)
    second = jsonl([embedding_line(f"s{i}", "x" * 800, queue) for i in range(900)])  # 900 KB
    with ThreadPoolExecutor(1) as pool:
        try:
            uploading = pool.submit(http.post, "/v1/files", content=first(), headers=FORM_TYPE)
            # Its first 512 lines are in Redis: at least 512 KB of the budget are held.
            wait_until(lambda: bool(admin.keys(keys.lines("file-*"))), "the first upload")
            with pytest.raises(openai.RateLimitError) as refused:
                upload(client, second)  # declares 900 KB: refused before it is read
            assert refused.value.code == "upload_budget_exceeded"
            assert refused.value.response.headers["retry-after"]
            assert "upload_budget_bytes=" in refused.value.message
        finally:
            release.set()
        assert uploading.result().status_code == 200
    admin.close()
    assert upload(client, second).bytes == len(second)  # the budget is free again
