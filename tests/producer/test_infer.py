"""How ``infer`` writes its request and waits on its result alone: writes refused (queue
full, Redis unreachable or out of memory), cut or paused; timed-out and cancelled calls;
``map``'s order; ``wait`` once the result arrived. (How results come back: test_replies.py.)

Where a test needs results to arrive in a given order, it pushes reply entries by hand onto
the producer's reply stream (replies_by_hand.py), as the completion script would (the
protocol in docs/protocol.md), instead of racing a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import ConnectionError as RedisConnectionError

from batchline.codec import Limits, Result, decode_request, request_value
from batchline.errors import (
    EnqueueTimeout,
    EnqueueUncertain,
    QueueFull,
    RequestCancelled,
    RequestTimeout,
    ServiceUnavailable,
)
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer, Producer
from batchline.producer._replies import Waiters
from batchline.transport import Backoff

from tests.support.models_for_tests import GatedModel
from tests.support.replies_by_hand import eventually, flat, producer, push_reply
from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, pending_count, queued

__all__ = ["producer"]  # the fixture, used here

T = RESULT_TIMEOUT_S


async def depth_is(producer: AsyncProducer, n: int) -> bool:
    return await producer.queue_depth() == n


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- writes refused, cut or paused -------------------------------------------------------------


async def test_a_worker_write_refused_for_memory_waits_until_memory_frees(
    redis_url: str, queue: str, rclient: redis.Redis, keys: QueueKeys
) -> None:
    # The completion script acknowledges first, after which Redis lets a script finish even
    # out of memory; a write refused outright is waited out, not given up (entries pending).
    # The worker's writer retries its writes with Backoff.retry, tested here alone.
    retry = Backoff(logging.getLogger("test"), "writer", max_delay_s=1.0)
    client = AsyncRedis.from_url(redis_url)
    calls = 0

    async def attempt() -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:  # memory frees up
            rclient.config_set("maxmemory", 0)
        return await client.set(keys.result("oom"), "answered")

    try:
        with out_of_memory(rclient):
            assert await retry.retry(attempt, budget_s=30.0) is True
    finally:
        await client.aclose()
    assert calls == 3
    assert rclient.get(keys.result("oom")) == b"answered"


def held_writes(client: redis.Redis) -> list[int]:
    """Ids of the clients whose write Redis holds (paused), the reply readers' XREAD aside."""
    return [int(c["id"]) for c in client.client_list() if "b" in c["flags"] and c["cmd"] != "xread"]


@contextlib.contextmanager
def paused_writes(client: redis.Redis, *, limit_ms: int = 30_000) -> Iterator[None]:
    """CLIENT PAUSE WRITE for the block (at most ``limit_ms``, whatever happens)."""
    client.execute_command("CLIENT", "PAUSE", limit_ms, "WRITE")
    try:
        yield
    finally:
        client.execute_command("CLIENT", "UNPAUSE")


@pytest.mark.slow
async def test_a_write_cut_by_a_lost_connection_is_enqueue_uncertain(
    producer: AsyncProducer,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    assert await producer.queue_depth() == 0  # connected
    with paused_writes(rclient):
        task = asyncio.create_task(producer.infer("x", request_id="cut", timeout_s=T))
        # Deterministic: the write is held by Redis, then its connection is killed.
        held = await eventually(lambda: held_writes(rclient), "the write to be held")
        for client_id in held:
            rclient.client_kill_filter(_id=client_id)
        with pytest.raises(EnqueueUncertain, match="may or may not be queued") as caught:
            await task
    error = caught.value
    assert error.request_id == "cut"
    assert "get_result('cut')" in str(error)
    assert "request_id='cut'" in str(error)
    assert not isinstance(error, RequestTimeout)
    assert producer._waiting == {}
    # What the message says to do works: resubmit with the same id (it was not queued here).
    start_worker()
    if await producer.get_result("cut") is None:
        assert await producer.infer("x", request_id="cut", timeout_s=T) == "x"
    assert await producer.infer("later", timeout_s=T) == "later"


@pytest.mark.slow
async def test_a_writer_connection_that_died_idle_is_replaced_before_the_write(
    redis_url: str, queue: str, rclient: redis.Redis
) -> None:
    # redis-py PINGs a connection idle past health_check_interval before its next command;
    # the producer runs that PING before sending, so a dead idle connection costs nothing
    # (neither a refused nor an uncertain write).
    url = f"{redis_url}?health_check_interval=1"
    async with AsyncProducer(redis_url=url, queue=queue) as producer:
        await producer.submit("a")
        writers = [int(c["id"]) for c in rclient.client_list() if c["cmd"] == "fcall"]
        assert len(writers) == 1, writers
        rclient.client_kill_filter(_id=writers[0])
        await asyncio.sleep(1.2)  # past the interval: the next write is preceded by a PING
        await producer.submit("b")
        assert await producer.queue_depth() == 2


@pytest.mark.slow
async def test_a_write_paused_past_the_socket_timeout_is_enqueue_timeout(
    redis_url: str, queue: str, start_worker: Callable[..., WorkerThread], rclient: redis.Redis
) -> None:
    url = f"{redis_url}?socket_timeout=1.5"  # longer than the reply reader's 1 s block
    async with AsyncProducer(redis_url=url, queue=queue) as producer:
        assert await producer.queue_depth() == 0
        with paused_writes(rclient):
            with pytest.raises(EnqueueTimeout) as caught:
                await producer.infer("x", request_id="paused", timeout_s=T)
            # A RequestTimeout (and a TimeoutError) that says the request may be queued.
            assert isinstance(caught.value, RequestTimeout)
            assert isinstance(caught.value, EnqueueUncertain)
            assert caught.value.request_id == "paused"
            with pytest.raises(EnqueueTimeout):
                await producer.submit("y")
            assert await producer.get_result("paused") is None  # reads are not paused
        start_worker()
        assert await producer.infer("after", timeout_s=T) == "after"
        # Whether the paused write went through once the pause ended is not known to the
        # producer; if it did, the request is answered (once), as the error said.
        found = await producer.get_result("paused")
        assert found is None or found.output == "x"


@pytest.mark.slow
async def test_without_a_socket_timeout_a_write_waits_out_a_long_pause(
    redis_url: str, queue: str, start_worker: Callable[..., WorkerThread], rclient: redis.Redis
) -> None:
    """No socket timeout unless the URL sets one (docs/service.md): a write held past the
    5 s that redis-py would cut a command at (a large AOF rewrite, a long script) is
    queued once Redis answers, not refused."""
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        assert await producer.queue_depth() == 0
        with paused_writes(rclient):
            task = asyncio.create_task(producer.submit("x", request_id="held"))
            await eventually(lambda: held_writes(rclient), "the write to be held")
            await asyncio.sleep(5.5)  # past redis-py's own default of 5 s
            assert not task.done()
        handle = await task
        start_worker()
        assert await producer.result(handle, timeout_s=T) == "x"


# -- infer waits once, on its result -----------------------------------------------------------


async def test_infer_raises_queue_full_when_the_queue_is_full(
    redis_url: str, queue: str, rclient: redis.Redis, keys: QueueKeys
) -> None:
    async with AsyncProducer(redis_url=redis_url, queue=queue, max_queue_depth=2) as producer:
        held = [await producer.submit(i) for i in range(2)]
        async with asyncio.timeout(T):  # a refused write must not leave a caller hanging
            with pytest.raises(QueueFull, match="max_queue_depth=2"):
                await producer.infer("refused", request_id="refused")
            outcomes = await asyncio.gather(
                *(producer.infer(i) for i in range(5)), return_exceptions=True
            )
            with pytest.raises(QueueFull):
                await producer.map(["m1", "m2"])
        assert all(isinstance(x, QueueFull) for x in outcomes), outcomes
        assert set(producer._waiting) == {h.id for h in held}
        assert queued(rclient, keys) == 2


async def test_a_failed_write_raises_to_the_infer_caller(queue: str) -> None:
    url = f"redis://127.0.0.1:{closed_port()}/0"
    async with AsyncProducer(redis_url=url, queue=queue) as producer:
        async with asyncio.timeout(T):
            # Never connected, so nothing was sent: certainly not queued, retryable.
            with pytest.raises(ServiceUnavailable, match="unreachable") as caught:
                await producer.infer("x")
            assert isinstance(caught.value.__cause__, RedisConnectionError)
            outcomes = await asyncio.gather(
                *(producer.infer(i) for i in range(5)), return_exceptions=True
            )
            with pytest.raises(ServiceUnavailable):
                await producer.map(["a", "b"])
            with pytest.raises(ServiceUnavailable):
                await producer.submit("y")
            with pytest.raises(ServiceUnavailable):
                await producer.get_result("y")
            with pytest.raises(ServiceUnavailable):
                await producer.queue_depth()
        assert all(isinstance(x, ServiceUnavailable) for x in outcomes), outcomes
        assert producer._waiting == {}


@contextlib.contextmanager
def out_of_memory(client: redis.Redis) -> Iterator[None]:
    """The session's Redis at maxmemory (noeviction) for the block; restored after."""
    before = client.config_get("maxmemory")["maxmemory"]
    policy = client.config_get("maxmemory-policy")["maxmemory-policy"]
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    try:
        yield
    finally:
        client.config_set("maxmemory", before)
        client.config_set("maxmemory-policy", policy)


@pytest.mark.slow
async def test_redis_out_of_memory_is_service_unavailable_and_nothing_is_lost(
    producer: AsyncProducer,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    gate = GatedModel()
    thread = start_worker(model=gate, batch_size=4, timeout_ms=0)
    held = [await producer.submit(f"held{i}") for i in range(4)]
    assert await asyncio.to_thread(gate.entered.wait, T), "no batch reached the model"
    with out_of_memory(rclient):
        # The enqueue script is refused at its first write: nothing was queued.
        with pytest.raises(ServiceUnavailable, match="out of memory") as caught:
            await producer.infer("refused", request_id="refused", timeout_s=T)
        assert caught.value.retryable
        with pytest.raises(ServiceUnavailable, match="out of memory"):
            await producer.submit("refused2")
        with pytest.raises(ServiceUnavailable, match="out of memory"):
            await producer.cancel("some-id")  # a plain command (OutOfMemoryError)
        assert await producer.queue_depth() == 4  # reads still work
        assert producer._waiting.keys() == {h.id for h in held}
        # The worker's write goes on: the completion script acknowledges first, and a script
        # that has written may finish (Redis does not stop one half way).
        gate.release.set()
        outputs = [await producer.result(h, timeout_s=T) for h in held]
        assert outputs == [f"held{i}" for i in range(4)]
    assert thread.alive
    assert await producer.infer("after", timeout_s=T) == "after"
    assert await producer.get_result("refused") is None
    assert queued(rclient, keys) == 0
    assert pending_count(rclient, keys) == 0


async def test_infer_times_out_and_forgets_its_request(
    producer: AsyncProducer, rclient: redis.Redis, keys: QueueKeys
) -> None:
    with pytest.raises(RequestTimeout, match="slow"):
        await producer.infer("no worker serves this", timeout_s=0.05, request_id="slow")
    assert producer._waiting == {}
    # The request went out all the same; its late answer is dropped quietly.
    await eventually(producer.queue_depth, "the request to be written")
    push_reply(rclient, keys, producer.producer_id, [flat(Result("slow", "ok", "late"))])
    task = asyncio.create_task(producer.infer("next", request_id="next", timeout_s=T))
    await eventually(lambda: "next" in producer._waiting, "infer to register its waiter")
    push_reply(rclient, keys, producer.producer_id, [flat(Result("next", "ok", "N"))])
    assert await task == "N"
    assert producer._waiting == {}


async def test_cancelling_an_infer_forgets_its_request(
    producer: AsyncProducer, rclient: redis.Redis, keys: QueueKeys
) -> None:
    early = asyncio.create_task(producer.infer("a", request_id="early"))
    await eventually(lambda: "early" in producer._waiting, "infer to register its waiter")
    early.cancel()  # before or while its write is in flight
    with pytest.raises(asyncio.CancelledError):
        await early
    assert producer._waiting == {}
    late = asyncio.create_task(producer.infer("b", request_id="late"))
    # Both were written ("early" too: its write had been queued), then "late" is cancelled.
    await eventually(lambda: depth_is(producer, 2), "both requests to be written")
    assert "late" in producer._waiting
    late.cancel()
    with pytest.raises(asyncio.CancelledError):
        await late
    assert producer._waiting == {}
    # Their answers come anyway and are dropped; the reader carries on.
    nxt = asyncio.create_task(producer.infer("c", request_id="next", timeout_s=T))
    await eventually(lambda: "next" in producer._waiting, "infer to register its waiter")
    push_reply(
        rclient,
        keys,
        producer.producer_id,
        [flat(Result("early", "ok", "A")), flat(Result("late", "ok", "B"))],
    )
    push_reply(rclient, keys, producer.producer_id, [flat(Result("next", "ok", "C"))])
    assert await nxt == "C"
    assert producer._waiting == {}


async def test_waiters_forget_an_id_with_its_input_hash() -> None:
    waiters = Waiters()
    first, second = waiters.add("r", "h1"), waiters.add("r", "h2")
    other = waiters.add("s", "h3")
    assert waiters.inputs == {"r": "h1", "s": "h3"}  # a resubmit keeps the first
    assert waiters.forget("r") == [first, second]  # cancel(): every waiter of the id
    assert waiters.forget("r") == []
    assert waiters.inputs == {"s": "h3"}
    waiters.drop("s", other)  # its last waiter gave up: the id goes with its hash
    assert (dict(waiters), waiters.inputs) == ({}, {})


async def test_map_returns_outputs_in_order_whatever_order_they_arrive_in(
    producer: AsyncProducer, rclient: redis.Redis, keys: QueueKeys
) -> None:
    values = list(range(12))
    task = asyncio.create_task(producer.map(values, timeout_s=T))
    await eventually(lambda: depth_is(producer, len(values)), "every request written")
    requests = [decode_request(raw) for s in keys.streams for _entry, raw in rclient.xrange(s)]
    assert sorted(request_value(r, Limits()) for r in requests) == values
    # A fake worker: answers last-submitted first, one entry each, then two at once.
    answers = [flat(Result(r["id"], "ok", -request_value(r, Limits()))) for r in reversed(requests)]
    for answer in answers[:-2]:
        push_reply(rclient, keys, producer.producer_id, [answer])
    push_reply(rclient, keys, producer.producer_id, answers[-2:])
    assert await task == [-v for v in values]
    assert producer._waiting == {}


async def test_wait_after_the_result_arrived_returns_at_once(
    producer: AsyncProducer, rclient: redis.Redis, keys: QueueKeys
) -> None:
    handle = await producer.submit("x", request_id="w1")
    marker = await producer.submit("y", request_id="w2")
    push_reply(rclient, keys, producer.producer_id, [flat(Result("w1", "ok", "X"))])
    push_reply(rclient, keys, producer.producer_id, [flat(Result("w2", "ok", "Y"))])
    assert await producer.result(marker, timeout_s=T) == "Y"  # so w1's entry was read too
    # No result key exists (the replies came by hand) and a zero timeout fails any wait
    # that suspends: the result can only come from the producer's own future, at once.
    assert not rclient.exists(keys.result("w1"))
    first = await producer.wait(handle, timeout_s=0)
    assert (first.status, first.output) == ("ok", "X")
    assert await producer.wait(handle, timeout_s=0) is first
    assert await producer.result(handle) == "X"


async def test_a_request_cancelled_here_raises_request_cancelled_when_waited_for_by_id(
    producer: AsyncProducer,
) -> None:
    """docs/service.md, Cancelling: after ``cancel``, ``result`` and ``wait`` raise
    RequestCancelled, whether given the handle or the request's id (no worker: nothing has
    written the id's result key yet, which would then say what became of it)."""
    handle = await producer.submit("never mind", request_id="gone")
    await producer.cancel(handle.id)
    for waited in (handle, "gone"):
        with pytest.raises(RequestCancelled):
            await producer.result(waited, timeout_s=1)
    with pytest.raises(KeyError):  # an id never sent here is still unknown
        await producer.wait("never-sent", timeout_s=1)


async def test_map_refuses_one_request_id_for_many_values(producer: AsyncProducer) -> None:
    with pytest.raises(TypeError, match="map takes no request_id"):
        await producer.map(["a", "b"], request_id="m1")
    assert producer._waiting == {}  # nothing sent


def test_the_sync_producer_counts_its_submits_as_the_async_one_does(
    redis_url: str, queue: str
) -> None:
    with Producer(redis_url=redis_url, queue=queue) as sync_producer:
        sync_producer.submit("a", request_id="counted")
        sync_producer.submit("a", request_id="counted")  # queued already: attached
        assert sync_producer.counts["queued"] + sync_producer.counts["attached"] == 2
        assert sync_producer.counts["queued"] >= 1
