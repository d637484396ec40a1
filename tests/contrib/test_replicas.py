"""Two API replicas in front of one queue (docs/tenants.md): a tenant's quota is one count
across both, and its requests through either take their turn in one fair share. Real uvicorn
servers, the official ``openai`` client, a real worker and Redis."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import redis

from batchline.keys import QueueKeys

from .openai.test_openai import client_for
from .test_fastapi import MODEL, Serve, serve
from .test_keys import Keys, MakeApp, make_app, prefix, store
from tests.support.service import WorkerThread, wait_until

openai = pytest.importorskip("openai")

__all__ = ["make_app", "prefix", "serve", "store"]  # fixtures, used here

pytestmark = pytest.mark.slow


def test_a_tenants_quota_is_one_count_across_two_replicas(
    make_app: MakeApp,
    serve: Serve,
    store: Keys,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    queue: str,
    prefix: str,
) -> None:
    start_worker(MODEL, prefix=prefix)
    key, _ = store.create("acme", config={"requests_per_min": 4})
    other, _ = store.create("globex")
    tenants = QueueKeys(queue, prefix=prefix).tenants
    wait_until(lambda: rclient.hget(tenants, "acme"), "acme's limits mirrored to the queue")
    assert json.loads(rclient.hget(tenants, "acme"))["requests_per_min"] == 4
    replicas = [client_for(serve(make_app(api_keys=True))) for _ in range(2)]
    acme = [client.with_options(api_key=key) for client in replicas]
    for client in (acme[0], acme[1], acme[0], acme[1]):  # 4 in this minute, 2 on each
        assert len(client.embeddings.create(model=queue, input="x").data) == 1
    for client in acme:  # the fifth is refused, on either replica
        with pytest.raises(openai.RateLimitError) as caught:
            client.with_options(max_retries=0).embeddings.create(model=queue, input="x")
        assert caught.value.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert int(caught.value.response.headers["retry-after"]) >= 1
    # another tenant's count is its own
    assert replicas[1].with_options(api_key=other).embeddings.create(model=queue, input="y").data
