"""Consumers of dead workers leave the consumer group: removed by prune_consumers on its own
(the session's redis-server), and by a running worker's janitor."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from batchline.keys import GROUP, QueueKeys
from batchline.producer import AsyncProducer
from batchline.worker.shared._consumers import prune_consumers

from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, wait_until


def _consumers(client: redis.Redis, keys: QueueKeys) -> dict[str, dict[str, int]]:
    """name -> {pending, idle} of every consumer of every work stream."""
    out: dict[str, dict[str, int]] = {}
    for stream in keys.streams:
        for c in client.xinfo_consumers(stream, GROUP):
            out[c["name"].decode()] = {"pending": c["pending"], "idle": c["idle"]}
    return out


def _ghosts(client: redis.Redis, keys: QueueKeys) -> None:
    """Two consumers left by dead workers: "ghost" holds nothing, "holder" one entry."""
    for stream in keys.streams:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    assert client.xgroup_createconsumer(keys.stream(0), GROUP, "ghost") == 1
    client.xadd(keys.stream(1), {"junk": "1"})
    assert client.xreadgroup(GROUP, "holder", {keys.stream(1): ">"}, count=1)
    assert client.xgroup_createconsumer(keys.stream(2), GROUP, "ghost-too") == 1


async def test_only_idle_consumers_without_pending_entries_are_removed(
    rclient: redis.Redis, aclient: AsyncRedis, keys: QueueKeys
) -> None:
    _ghosts(rclient, keys)
    assert set(_consumers(rclient, keys)) == {"ghost", "holder", "ghost-too"}
    streams = list(reversed(keys.streams))
    # An idle bound no consumer has reached yet: nothing is removed.
    assert await prune_consumers(aclient, streams, idle_ms=3_600_000, keep="me") == []
    # Kept by name.
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    removed: list[str] = []
    while "ghost" not in removed:  # idle must exceed 0 ms: at most a few tries
        assert time.monotonic() < deadline
        removed += await prune_consumers(aclient, streams, idle_ms=0, keep="ghost-too")
        await asyncio.sleep(0.005)
    assert removed == ["ghost"]
    assert set(_consumers(rclient, keys)) == {"holder", "ghost-too"}
    assert _consumers(rclient, keys)["holder"]["pending"] == 1  # its entry is still pending
    # A queue whose group is missing (Redis lost its data) is skipped, not an error.
    empty = QueueKeys(keys.queue + "-none")
    assert await prune_consumers(aclient, empty.streams, idle_ms=0, keep="x") == []


@pytest.mark.slow
async def test_the_janitor_removes_the_consumers_of_dead_workers(
    redis_url: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    start_worker: Callable[..., WorkerThread],
) -> None:
    _ghosts(rclient, keys)
    assert set(_consumers(rclient, keys)) == {"ghost", "holder", "ghost-too"}
    thread = start_worker(claim_idle_ms=300, consumer_idle_ms=1000)
    me = thread.worker.worker_id
    # "holder"'s entry is reclaimed (and dead-lettered: it is junk), then "holder" goes too.
    wait_until(
        lambda: set(_consumers(rclient, keys)) <= {me},
        "the dead workers' consumers to be removed",
        timeout_s=RESULT_TIMEOUT_S,
    )
    assert rclient.xlen(keys.dead) == 1
    async with AsyncProducer(redis_url=redis_url, queue=keys.queue) as producer:
        assert await producer.infer("still served", timeout_s=RESULT_TIMEOUT_S) == "still served"
    assert set(_consumers(rclient, keys)) == {me}
