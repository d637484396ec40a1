"""Tenants apart in the HTTP API: the official ``openai`` client over uvicorn and the session's
redis-server, one client per tenant (and an admin's): another tenant's files, batches and
jobs are 404, as unknown ids; lists show one's own; an admin sees every one; a tenant's
requests, and its batch's lines, go in its name."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis
from pydantic import SecretStr

from batchline.codec import Result, encode_result, pack_result
from batchline.config import WebSettings
from batchline.errors import QuotaExceeded
from batchline.keys import BatchApiKeys, QueueKeys
from batchline.producer import AsyncProducer

from ..openai.test_openai import client_for
from ..test_fastapi import Serve, serve
from ..test_keys import Keys
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

openai = pytest.importorskip("openai")

__all__ = ["embedder", "make_app", "serve"]  # fixtures, used here

#: The tenants of the test's keys ("ops" holds an admin key).
TENANTS = {"a": "acme", "b": "bravo", "admin": "ops"}


@dataclass
class Tenants:
    """The app under uvicorn, and a key of the tenant store for each of TENANTS."""

    http: httpx.Client
    keys: dict[str, str]

    def client(self, who: str) -> Any:
        """The official client with ``who``'s key."""
        return client_for(self.http).with_options(api_key=self.keys[who])

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}"}

    def get(self, who: str, path: str) -> httpx.Response:
        return self.http.get(path, headers=self.auth(who))


@pytest.fixture
def tenants(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    redis_url: str,
    queue: str,
) -> Callable[..., Tenants]:
    """``tenants(**settings)``: the app checking keys (``api_keys``), served, with a key for
    each of TENANTS made in its tenant store."""

    def start(**settings: Any) -> Tenants:
        store = Keys(redis_url, queue)
        keys = {
            who: store.create(tenant, admin=who == "admin")[0] for who, tenant in TENANTS.items()
        }
        return Tenants(serve(make_app(api_keys=True, **settings)), keys)

    return start


def not_found(call: Callable[[], Any]) -> dict[str, Any]:
    """The 404 error object ``call`` gets."""
    with pytest.raises(openai.NotFoundError) as caught:
        call()
    error: dict[str, Any] = caught.value.response.json()["error"]
    return error


def same_as_unknown(call: Callable[[str], Any], object_id: str, unknown: str) -> None:
    """``call(object_id)`` answers as ``call(unknown)`` does: 404, the same error but the id."""
    seen = not_found(lambda: call(object_id))
    want = not_found(lambda: call(unknown))
    assert seen["message"] == want["message"].replace(unknown, object_id), (seen, want)
    assert {k: v for k, v in seen.items() if k != "message"} == {
        k: v for k, v in want.items() if k != "message"
    }


def test_files_and_batches_are_their_tenants_own(
    tenants: Callable[..., Tenants], queue: str, redis_url: str
) -> None:
    """Nothing is queued (no driver): the routes alone keep tenants apart."""
    by = tenants(batch_driver="off")
    a, b, admin = by.client("a"), by.client("b"), by.client("admin")
    data = jsonl([embedding_line("x", "a text", queue)])
    a_files = [upload(a, data) for _ in range(3)]
    b_file = upload(b, data)

    def create(client: Any, file_id: str) -> Any:
        return client.batches.create(
            input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
        )

    a_batch, b_batch = create(a, a_files[0].id), create(b, b_file.id)
    mine = a_files[0].id
    same_as_unknown(b.files.retrieve, mine, "file-unknown")
    same_as_unknown(b.files.content, mine, "file-unknown")
    same_as_unknown(b.files.delete, mine, "file-unknown")
    same_as_unknown(lambda i: create(b, i), mine, "file-unknown")  # not B's input
    same_as_unknown(b.batches.retrieve, a_batch.id, "batch_unknown")
    same_as_unknown(b.batches.cancel, a_batch.id, "batch_unknown")

    # Lists: one's own (auto-paginated a page at a time), an admin's every one.
    assert {f.id for f in a.files.list(limit=2)} == {f.id for f in a_files}
    assert [f.id for f in b.files.list()] == [b_file.id]
    assert [x.id for x in b.batches.list()] == [b_batch.id]
    assert [x.id for x in a.batches.list(limit=1)] == [a_batch.id]
    assert [x.id for x in b.batches.list(after=a_batch.id)] == [b_batch.id]  # from the start
    assert {f.id for f in admin.files.list()} == {f.id for f in [*a_files, b_file]}
    assert {x.id for x in admin.batches.list()} == {a_batch.id, b_batch.id}
    assert admin.files.content(mine).text == data.decode()
    assert admin.batches.retrieve(a_batch.id).input_file_id == mine

    # In Redis: the file's hash holds its owner, the owner's index its id, another's not.
    keys, client = BatchApiKeys(queue), redis.Redis.from_url(redis_url)
    try:
        assert client.hget(keys.file(mine), "tenant") == b"acme"
        assert client.zscore(keys.tenant_files("acme"), mine) is not None
        assert client.zscore(keys.tenant_files("bravo"), mine) is None
        assert client.zscore(keys.files, mine) is not None
        # An object stored before tenants (no owner) is the open API's and an admin's alone.
        client.hdel(keys.file(b_file.id), "tenant")
    finally:
        client.close()
    not_found(lambda: b.files.retrieve(b_file.id))
    assert admin.files.retrieve(b_file.id).id == b_file.id
    assert b.files.list().data == []

    # The owner deletes and cancels its own; then nobody sees it.
    assert a.files.delete(a_files[1].id).deleted
    assert {f.id for f in a.files.list()} == {a_files[0].id, a_files[2].id}
    assert {f.id for f in admin.files.list()} == {a_files[0].id, a_files[2].id, b_file.id}
    assert a.batches.cancel(a_batch.id).status == "cancelling"
    admin.files.delete(a_files[2].id)  # an admin deletes any tenant's
    assert [f.id for f in a.files.list()] == [a_files[0].id]


def test_a_tenants_job_is_404_to_another_tenant(
    tenants: Callable[..., Tenants], queue: str, redis_url: str
) -> None:
    """A job of acme's, done (its job and result keys as a worker leaves them): acme and an
    admin read it; bravo gets the 404 of an unknown job."""
    by = tenants(batch_driver="off")
    keys = WebSettings(redis_url=SecretStr(redis_url), queue=queue, prefix=queue).keys
    job_id, unknown = f"acme.{uuid.uuid4().hex}", f"acme.{uuid.uuid4().hex}"
    done = Result(id=job_id, status="ok", output=[0.5, 0.25], batch_size=1)
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(keys.job(job_id), "embedding", ex=60)
        client.set(keys.result(job_id), pack_result(encode_result(done)), ex=60)
    finally:
        client.close()

    for who in ("a", "admin"):
        answer = by.get(who, f"/jobs/{job_id}")
        assert answer.status_code == 200, answer.text
        assert answer.json()["embedding"] == [0.5, 0.25]
    hidden, missing = by.get("b", f"/jobs/{job_id}"), by.get("b", f"/jobs/{unknown}")
    assert hidden.status_code == missing.status_code == 404
    assert hidden.json() == {k: v.replace(unknown, job_id) for k, v in missing.json().items()}, (
        "another tenant's job answers as an unknown one"
    )


def stream_entries(client: redis.Redis, keys: QueueKeys) -> list[dict[bytes, bytes]]:
    """Every entry of the queue's work streams (those delivered and not answered yet)."""
    return [fields for stream in keys.streams for _, fields in client.xrange(stream)]


@pytest.mark.slow
def test_a_tenants_requests_and_its_batchs_lines_go_in_its_name(
    tenants: Callable[..., Tenants],
    start_worker: Callable[..., WorkerThread],
    queue: str,
    redis_url: str,
) -> None:
    """Through the queue: acme's request, job and batch lines are acme's requests (ids in
    its namespace, ``tn`` acme on the work stream); bravo reads none of their answers."""
    batch_models.reset()
    start_worker(COUNTING, prefix=queue)
    by = tenants()
    a, b, admin = by.client("a"), by.client("b"), by.client("admin")
    keys = WebSettings(redis_url=SecretStr(redis_url), queue=queue, prefix=queue).keys
    client = redis.Redis.from_url(redis_url)
    try:
        assert len(a.embeddings.create(model=queue, input="one").data) == 1
        results = [k.decode() for k in client.scan_iter(keys.result("acme.") + "*")]
        assert results, "acme's request has a result key in acme's namespace"

        posted = by.http.post("/jobs", json={"text": "two"}, headers=by.auth("a"))
        job = posted.json()["id"]
        assert posted.status_code == 202, posted.text
        assert job.startswith("acme."), job
        wait_until(lambda: by.get("a", f"/jobs/{job}").status_code == 200, "acme's job done")
        assert by.get("b", f"/jobs/{job}").status_code == 404
        assert by.get("admin", f"/jobs/{job}").status_code == 200

        batch_models.reset(hold_after=0)  # the model holds each text until GATE opens
        lines = [embedding_line(f"l{i}", f"text {i}", queue) for i in range(3)]
        batch = a.batches.create(
            input_file_id=upload(a, jsonl(lines)).id,
            endpoint="/v1/embeddings",
            completion_window="24h",
        )
        wait_until(lambda: stream_entries(client, keys), "a line of the batch on the stream")
        for fields in stream_entries(client, keys):
            assert fields[b"id"].startswith(f"acme.{batch.input_file_id}.".encode()), fields
            assert fields.get(b"tn") == b"acme", fields
    finally:
        batch_models.GATE.set()
        client.close()
    done = finished(a, batch.id)
    assert (done.status, done.request_counts.completed) == ("completed", 3)
    answers = file_lines(a, done.output_file_id)
    assert all(x["response"]["request_id"].startswith("acme.") for x in answers.values())
    same_as_unknown(b.files.content, done.output_file_id, "file-unknown")
    assert [f.id for f in b.files.list()] == []
    assert len(file_lines(admin, done.output_file_id)) == 3


@pytest.mark.slow
def test_a_batch_line_over_a_quota_waits_for_it_instead_of_failing(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    embedder: None,
    queue: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each line's first submit is refused for a quota (as the producer raises it): the
    driver submits it again when the quota says, and every line is answered."""
    refused: Counter[str] = Counter()
    submit = AsyncProducer.submit

    async def over_once(self: AsyncProducer, value: Any, **options: Any) -> Any:
        rid = options.get("request_id")
        if rid is not None and not refused[rid]:
            refused[rid] += 1
            message = "tenant acme: requests_per_min=1 reached"
            raise QuotaExceeded(
                message, tenant="acme", limit="requests_per_min", retry_after_s=0.05
            )
        return await submit(self, value, **options)

    monkeypatch.setattr(AsyncProducer, "submit", over_once)
    client = client_for(serve(make_app(batch_driver="loop")))  # (the patch: in this process)
    lines = [embedding_line(f"l{i}", f"text {i}", queue) for i in range(3)]
    done = finished(client, embeddings_batch(client, lines).id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == (
        "completed",
        3,
        0,
    )
    assert len(refused) == 3
