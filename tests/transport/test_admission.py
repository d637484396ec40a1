"""Admission through the queue's functions (docs/protocol.md, Admission): what producers
append to the inbox is admitted by workers in order, a worker that dies with an element
taken loses nothing, a library gone is loaded again, and a producer finds its way in where
the functions are missing. Real Redis (7: functions), workers in this process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgpack
import pytest
import redis

from batchline.errors import ServiceUnavailable
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer
from batchline.transport import LIBRARY

from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, admit_inbox, admitted, wait_until

T = RESULT_TIMEOUT_S


async def test_an_element_a_dead_worker_took_is_admitted_by_the_next_call(
    redis_url: str, queue: str, rclient: redis.Redis, keys: QueueKeys
) -> None:
    """A worker moves the inbox's oldest element to the admission list, then dies before
    its admit call: whichever worker calls next admits it first, in order."""
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        handles = [await producer.submit(f"request {i}") for i in range(3)]
        assert rclient.lmove(keys.inbox, keys.admitting, "LEFT", "RIGHT")  # then it died
        admit_inbox(rclient, keys)
        assert admitted(rclient, keys)
        entries = rclient.xrange(keys.stream(1))
        assert [e[1][b"id"].decode() for e in entries] == [h.id for h in handles]


def test_cancels_are_admitted_in_order_with_their_requests(
    redis_url: str, queue: str, rclient: redis.Redis, keys: QueueKeys
) -> None:
    """A request and its cancel, appended one after the other: the cancel is added after
    the request's entry, so it covers it (a cancel covers the entries added before it)."""

    async def enqueue() -> str:
        async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
            handle = await producer.submit("doomed", reply=False)
            await producer.cancel(handle)
            return handle.id

    rid = asyncio.run(enqueue())
    kinds = [msgpack.unpackb(e)[0] for e in rclient.lrange(keys.inbox, 0, -1)]
    assert kinds == ["r", "c"]
    admit_inbox(rclient, keys)
    ((entry, _fields),) = rclient.xrange(keys.stream(1))
    ((cancel, fields),) = rclient.xrange(keys.cancels)
    assert fields[b"id"].decode() == rid
    assert entry.split(b"-")[0] <= cancel.split(b"-")[0]
    assert rclient.get(keys.request_input(rid)).endswith(b" !")  # a resubmit runs again


@pytest.mark.slow
async def test_a_library_gone_is_loaded_again_by_the_workers(
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    start_worker: Callable[..., WorkerThread],
) -> None:
    """FUNCTION FLUSH (or a failover to a node without the library): producers that may
    only use the functions are refused with a clear error until a worker loads it again,
    within about a second, without a request to admit."""
    start_worker()
    async with AsyncProducer(redis_url=redis_url, queue=queue, admission="functions") as p:
        assert await p.infer("before", timeout_s=T) == "before"
        rclient.function_flush()
        wait_until(rclient.function_list, "a worker to load the library again")
        assert await p.infer("after", timeout_s=T) == "after"
        refused = await _refused_while_gone(p, rclient)
        assert "is not loaded or not allowed" in str(refused)
    rclient.function_load(LIBRARY, replace=True)


async def _refused_while_gone(producer: AsyncProducer, client: redis.Redis) -> BaseException:
    """The error of a request sent just after the library was flushed (a worker may load it
    again in between: then again)."""
    while True:
        client.function_flush()
        try:
            await producer.infer("meanwhile", timeout_s=T)
        except ServiceUnavailable as exc:
            return exc


async def test_auto_uses_the_script_where_the_functions_are_missing(
    redis_url: str, queue: str, rclient: redis.Redis, keys: QueueKeys
) -> None:
    rclient.function_flush()
    try:
        async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
            await producer.submit("by the script")
            await producer.cancel("some-id")
        assert rclient.xlen(keys.stream(1)) == 1  # added by the script itself
        assert rclient.xlen(keys.cancels) == 1
        assert rclient.llen(keys.inbox) == 0
    finally:
        rclient.function_load(LIBRARY, replace=True)
    # Loaded again: a new producer (or this one, 10 s later) uses the functions.
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        await producer.submit("by the functions")
    assert rclient.llen(keys.inbox) == 1


async def test_a_write_puts_its_higher_priorities_first(
    redis_url: str, queue: str, rclient: redis.Redis, keys: QueueKeys
) -> None:
    """Requests put in one write go to the inbox highest priority first, each priority in
    the order put: an interactive request sent right after a burst of the lowest priority is
    admitted ahead of the burst."""
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        puts = [asyncio.ensure_future(producer.submit(f"low {i}", priority=0)) for i in range(8)]
        puts.append(asyncio.ensure_future(producer.submit("mid", priority=1)))
        puts.append(asyncio.ensure_future(producer.submit("high", priority=2)))
        handles = await asyncio.gather(*puts)
    ids = {h.id: i for i, h in enumerate(handles)}
    elements = [msgpack.unpackb(e) for e in rclient.lrange(keys.inbox, 0, -1)]
    order = [ids[dict(zip(e[2::2], e[3::2], strict=True))["id"]] for e in elements]
    assert order == [9, 8, 0, 1, 2, 3, 4, 5, 6, 7]


async def test_the_first_admit_call_after_a_wait_admits_the_head_of_a_burst(
    redis_url: str, queue: str, rclient: redis.Redis, keys: QueueKeys
) -> None:
    """A burst comes to an idle queue: the admitter's first call, sent with its wait on the
    inbox, admits the head of the burst (the element the wait moved and FIRST_CALL more),
    so that the head is read while the rest is admitted; the next calls admit the rest."""
    import redis.asyncio as aioredis

    from batchline.config import WorkerSettings
    from batchline.worker.serving._admitter import FIRST_CALL, Admitter

    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        handles = await asyncio.gather(*(producer.submit(i, reply=False) for i in range(100)))
    client = aioredis.Redis.from_url(redis_url)
    try:
        admitter = Admitter(client, WorkerSettings(queue=queue), worker_id="test")
        left = await admitter.wait_and_admit(client, keys.inbox, keys.admitting)
        assert rclient.xlen(keys.stream(1)) == 1 + FIRST_CALL
        assert left == 100 - 1 - FIRST_CALL
        while left:
            left = await admitter.admit()
    finally:
        await client.aclose()
    entries = rclient.xrange(keys.stream(1))
    assert [e[1][b"id"].decode() for e in entries] == [h.id for h in handles]
