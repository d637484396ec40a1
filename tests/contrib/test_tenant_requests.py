"""Every route of the app enqueues in its caller's tenant's name: with a tenant's key, each
request the OpenAI, TGI and TEI routes, ``/embed``, ``/jobs`` and ``/tokenize`` make is that
tenant's (its id in the tenant's namespace, its result key there), through uvicorn, the
session's redis-server and real workers (threads of this process)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from pydantic import SecretStr

from batchline.config import WebSettings
from batchline.contrib.fastapi import create_app
from batchline.keys import QueueKeys

from .openai.test_openai import client_for
from .test_fastapi import MODEL, Serve, serve
from .test_keys import Keys
from tests.support.service import RESULT_TIMEOUT_S, WorkerThread
from tests.worker.test_generate import CHAT, TINY

openai = pytest.importorskip("openai")

__all__ = ["serve"]  # a fixture, used here


def result_ids(client: redis.Redis, keys: QueueKeys) -> set[str]:
    """The request ids of the queue's result keys."""
    head = keys.result("")
    return {k.decode().removeprefix(head) for k in client.scan_iter(head + "*")}


@pytest.mark.slow
def test_every_route_enqueues_as_its_callers_tenant(
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
) -> None:
    gen = f"{queue}-gen"
    start_worker(MODEL, prefix=queue)
    start_worker("generate", model_path=TINY, queue=gen, prefix=queue, default_max_new_tokens=4)
    key, _ = Keys(redis_url, queue).create("acme")
    settings = WebSettings(
        redis_url=SecretStr(redis_url),
        queue=queue,
        prefix=queue,
        embedding_queue=queue,
        generation_queue=gen,
        api_keys=True,
    )
    http = serve(create_app(settings, timeout_s=RESULT_TIMEOUT_S))
    auth = {"Authorization": f"Bearer {key}"}
    client = client_for(http).with_options(api_key=key)

    assert len(client.embeddings.create(model=queue, input="a").data) == 1
    chunks = list(client.chat.completions.create(model=gen, messages=CHAT, stream=True))
    assert chunks
    assert all(c.id.startswith("chatcmpl-acme.") for c in chunks), chunks[0].id
    assert client.completions.create(model=gen, prompt="Once", max_tokens=2).id.startswith(
        "cmpl-acme."
    )
    calls = [
        ("/embed", {"text": "b"}),
        ("/embed", {"inputs": "c"}),  # TEI's
        ("/jobs", {"text": "d"}),
        ("/generate", {"inputs": "Once", "parameters": {"max_new_tokens": 2}}),
        ("/generate_stream", {"inputs": "Once", "parameters": {"max_new_tokens": 2}}),
        ("/tokenize", {"model": gen, "prompt": "Once"}),
    ]
    for path, body in calls:
        answer = http.post(path, json=body, headers=auth)
        assert answer.status_code in (200, 202), (path, answer.text)
    assert http.post("/embed", json={"text": "e"}, headers=auth).json()["id"].startswith("acme.")

    embed_keys = settings.keys
    gen_keys = settings.model_copy(update={"queue": gen}).keys
    client_redis = redis.Redis.from_url(redis_url)
    try:
        embedded, generated = (
            result_ids(client_redis, embed_keys),
            result_ids(client_redis, gen_keys),
        )
    finally:
        client_redis.close()
    # /v1/embeddings, /embed twice, TEI's /embed (and /jobs, unless it still runs)
    assert len(embedded) >= 4, embedded
    # the chat (streamed), the completion, /generate, /generate_stream, /tokenize
    assert len(generated) >= 5, generated
    assert all(rid.startswith("acme.") for rid in embedded | generated), embedded | generated
