"""Every route of the app enqueues in its caller's tenant's name: with a tenant's key, each
request the OpenAI, TGI and TEI routes, ``/embed``, ``/jobs`` and ``/tokenize`` make is that
tenant's (its id in the tenant's namespace, its result key there), through uvicorn, the
session's redis-server and real workers (threads of this process)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from pydantic import SecretStr

from batchline.config import WebSettings
from batchline.contrib.fastapi import create_app
from batchline.keys import QueueKeys

from .batches.test_batches import COUNTING
from .openai.test_openai import client_for
from .test_fastapi import MODEL, Serve, serve
from .test_keys import Keys
from tests.support import batch_models
from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, wait_until
from tests.worker.test_generate import CHAT, TINY

openai = pytest.importorskip("openai")

__all__ = ["serve"]  # a fixture, used here


def result_ids(client: redis.Redis, keys: QueueKeys) -> set[str]:
    """The request ids of the queue's result keys."""
    head = keys.result("")
    return {k.decode().removeprefix(head) for k in client.scan_iter(head + "*")}


MakeApp = Callable[..., tuple[httpx.Client, WebSettings]]


@pytest.fixture
def keyed_app(serve: Serve, redis_url: str, queue: str) -> MakeApp:  # noqa: F811
    """``keyed_app(**settings)``: the app checking the keys of its tenant store, its
    embedding queue ``queue``, served; its client and settings."""

    def make(**settings: Any) -> tuple[httpx.Client, WebSettings]:
        made = WebSettings(
            redis_url=SecretStr(redis_url),
            queue=queue,
            prefix=queue,
            embedding_queue=queue,
            api_keys=True,
            **settings,
        )
        return serve(create_app(made, timeout_s=RESULT_TIMEOUT_S)), made

    return make


@pytest.mark.slow
def test_every_route_enqueues_as_its_callers_tenant(
    keyed_app: MakeApp,
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    tmp_path: Path,
) -> None:
    from tests.support.tiny import tiny_cross_encoder

    gen, ranks = f"{queue}-gen", f"{queue}-rerank"
    start_worker(MODEL, prefix=queue)
    start_worker("generate", model_path=TINY, queue=gen, prefix=queue, default_max_new_tokens=4)
    start_worker(
        "cross-encoder",
        model_path=tiny_cross_encoder(tmp_path / "cross-encoder"),
        queue=ranks,
        prefix=queue,
        device="cpu",
    )
    key, _ = Keys(redis_url, queue).create("acme")
    http, settings = keyed_app(generation_queue=gen, rerank_queue=ranks)
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
        ("/detokenize", {"model": gen, "tokens": [70, 71]}),
        ("/v1/rerank", {"model": ranks, "query": "q", "documents": ["a", "b"]}),
        ("/rerank", {"query": "q", "texts": ["a", "b"]}),  # TEI's
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
    # the chat (streamed), the completion, /generate, /generate_stream, /tokenize, /detokenize
    assert len(generated) >= 6, generated
    ranked = result_ids(redis.Redis.from_url(redis_url), QueueKeys(ranks, prefix=queue))
    assert len(ranked) >= 2, ranked  # /v1/rerank, TEI's /rerank
    every = embedded | generated | ranked
    assert all(rid.startswith("acme.") for rid in every), every


@pytest.mark.slow
def test_tenants_never_share_cached_answers(
    keyed_app: MakeApp,
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
) -> None:
    """With the result cache on, the same text from two tenants is computed once for each;
    a tenant's repeat, and its job, are answered from its own cache entry."""
    batch_models.reset()
    start_worker(COUNTING, prefix=queue, cache_ttl_s=60)
    store = Keys(redis_url, queue)
    keys = {tenant: store.create(tenant)[0] for tenant in ("acme", "bravo")}
    http, _ = keyed_app(cache_ttl_s=60)
    for tenant in ("acme", "bravo", "acme"):
        client = client_for(http).with_options(api_key=keys[tenant])
        assert len(client.embeddings.create(model=queue, input="same").data) == 1
    assert batch_models.CALLS["same"] == 2, "computed once per tenant"

    acme, bravo = ({"Authorization": f"Bearer {keys[t]}"} for t in ("acme", "bravo"))
    job = http.post("/jobs", json={"texts": ["same"]}, headers=acme).json()["id"]
    wait_until(lambda: http.get(f"/jobs/{job}", headers=acme).status_code == 200, "the job")
    assert http.get(f"/jobs/{job}", headers=bravo).status_code == 404
    assert batch_models.CALLS["same"] == 2, "acme's job: a hit of acme's own entry"
