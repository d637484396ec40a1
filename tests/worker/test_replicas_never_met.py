"""``durability="replicated"`` with a replica count never met (docs/deploying.md, Redis):
every enqueue raises ``NotReplicated``, yet the primary holds the request and a worker still
runs it, and its result can be read by id."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from batchline.errors import NotReplicated
from batchline.producer import AsyncProducer

from tests.support.service import WorkerThread, poll_result

#: One Redis, no replica: one replica is never met. The wait kept short for the test.
REPLICATED = {"durability": "replicated", "min_replicas": 1, "replication_timeout_ms": 200}


async def test_a_request_never_replicated_raises_to_its_producer_yet_runs(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str
) -> None:
    start_worker(**REPLICATED)
    async with AsyncProducer(redis_url=redis_url, queue=queue, **REPLICATED) as producer:
        request_id = uuid.uuid4().hex
        with pytest.raises(NotReplicated) as refused:
            await producer.submit("held, not replicated", request_id=request_id)
        assert (refused.value.confirmed, refused.value.needed) == (0, 1)
        result = await poll_result(producer, request_id)
    assert result.status == "ok", result
    assert result.output == "held, not replicated"
