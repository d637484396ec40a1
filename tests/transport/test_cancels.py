"""Cancellation: producers append ids to the queue's cancel stream; each worker reads the
newest of what the stream holds from the last TTL as it starts (at most as many entries as it
may hold), then follows it, and skips a cancelled request as its batch starts, if the request
was added before the cancel.

CancelLog's expiry runs on a fake clock; catching up and following run on the session's
redis-server. End to end, the request is cancelled while the worker already holds it,
queued behind a batch that a gated model keeps running, and the test waits for the
cancellation to reach the worker (its CancelLog) before it opens the gate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from batchline.errors import RequestCancelled
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer
from batchline.transport import Admission
from batchline.transport._cancels import (
    CANCELS_MAXLEN,
    ID_OVERHEAD_BYTES,
    CancelLog,
    CancelTrim,
)

from tests.support.models_for_tests import GatedModel
from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerThread,
    pending_count,
    poll_result,
    wait_until,
)

T = RESULT_TIMEOUT_S
HUGE_MS = 600_000.0  # a batch timeout that never fires: batches flush by size


class FakeClock:
    """Monotonic seconds that move only when a test moves them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def producer(redis_url: str, queue: str) -> AsyncIterator[AsyncProducer]:
    async with AsyncProducer(redis_url=redis_url, queue=queue, result_ttl_s=300) as p:
        yield p


class CountingClient:
    """An asyncio client that counts its stream reads (how many pages a catch-up took) and
    the entries they brought."""

    def __init__(self, client: AsyncRedis) -> None:
        self._client = client
        self.xreads = 0
        self.entries = 0

    async def xread(self, *args: Any, **kwargs: Any) -> Any:
        self.xreads += 1
        return await self._client.xread(*args, **kwargs)

    async def xrevrange(self, *args: Any, **kwargs: Any) -> Any:
        self.xreads += 1
        page = await self._client.xrevrange(*args, **kwargs)
        self.entries += len(page)
        return page


# -- CancelLog on its own ----------------------------------------------------------------------


def test_ids_are_kept_for_their_ttl_then_forgotten() -> None:
    clock = FakeClock()
    log = CancelLog(10, clock=clock)
    assert len(log) == 0
    assert not log
    assert "a" not in log
    log.add("a")
    clock.now += 5
    log.add("b")
    assert ("a" in log, "b" in log, len(log)) == (True, True, 2)
    assert 42 not in log  # anything, not only strings, may be asked about
    clock.now += 4.9  # "a" is 9.9 s old: kept
    log.add("c")
    assert ("a" in log, len(log)) == (True, 3)
    clock.now += 0.2  # "a" is 10.1 s old: forgotten with the next add
    log.add("d")
    assert "a" not in log
    assert ("b" in log, "c" in log, "d" in log, len(log)) == (True, True, True, 3)


def test_a_rerun_admitted_after_a_cancel_is_covered_only_by_a_later_one() -> None:
    """An entry's ca (the newest cancel entry as the admission added it) decides, not the
    times: a cancel in the same millisecond, before it, does not cover it."""
    log = CancelLog(10, clock=FakeClock())
    log.add("a", 1000, 3)  # cancel entry 1000-3
    assert log.covers("a", b"1000-0", 999.0)  # by time: an entry of that ms or older
    assert not log.covers("a", b"1000-5", 999.0, after="1000-3")  # admitted after it
    assert log.covers("a", b"1000-5", 999.0, after="1000-2")  # before it
    assert log.covers("a", b"1001-0", 1001.0, after="999-9")
    log.add("a", 1000, 7)  # cancelled again, after the rerun was admitted
    assert log.covers("a", b"1000-5", 999.0, after="1000-3")
    # A cancel of the worker's own (its producer gone), not in the stream's order: by time.
    log.add("b", 1000)
    assert not log.covers("b", b"1001-0", 1001.0, after="0-0")
    assert log.covers("b", b"1000-0", 999.0, after="0-0")


def test_adding_an_id_again_refreshes_it() -> None:
    clock = FakeClock()
    log = CancelLog(10, clock=clock)
    log.add("a")
    clock.now += 1
    log.add("b")
    clock.now += 8
    log.add("a")  # refreshed: kept until 19 s from the start, and now the newest
    assert len(log) == 2
    clock.now += 2.5  # "a" was first added 11.5 s ago, "b" 10.5 s ago
    log.add("c")
    assert "b" not in log  # the oldest one, gone
    assert "a" in log  # refreshed: still kept
    assert len(log) == 2
    clock.now += 8  # 10.5 s after its refresh
    log.add("d")
    assert "a" not in log
    assert ("c" in log, "d" in log, len(log)) == (True, True, 2)


def test_no_id_counts_as_cancelled_after_its_ttl() -> None:
    clock = FakeClock()
    log = CancelLog(10, clock=clock)
    for rid in ("a", "b", "c"):
        log.add(rid)
    clock.now += 60
    assert "a" not in log  # 60 s old, with a TTL of 10 s
    log.add("d")
    assert ("b" in log, "c" in log, len(log)) == (False, False, 1)


def test_invalid_ids_are_ignored_and_counted() -> None:
    log = CancelLog(10, clock=FakeClock())
    junk = ["", "x" * 129, "a b", "a\n", "caf\u00e9", "a:b", "{q}", "a*"]
    for rid in junk:
        log.add(rid)
    log.add("x" * 128)
    assert (len(log), log.ignored, log.evicted) == (1, len(junk), 0)
    assert [rid in log for rid in junk] == [False] * len(junk)


def test_the_oldest_ids_go_first_past_max_ids() -> None:
    clock = FakeClock()
    log = CancelLog(10, clock=clock, max_ids=3)
    for rid in "abcde":
        log.add(rid)
        clock.now += 0.1
    assert [rid in log for rid in "abcde"] == [False, False, True, True, True]
    assert (len(log), log.evicted) == (3, 2)


def test_the_oldest_ids_go_first_past_max_bytes() -> None:
    clock = FakeClock()
    per_id = 100 + ID_OVERHEAD_BYTES
    log = CancelLog(10, clock=clock, max_bytes=10 * per_id)
    ids = [f"{i:0100d}" for i in range(25)]
    for rid in ids:
        log.add(rid)
        assert log.held_bytes <= 10 * per_id
    assert [rid in log for rid in ids] == [False] * 15 + [True] * 10
    assert (log.held_bytes, log.evicted) == (10 * per_id, 15)
    clock.now += 11  # all past their TTL: nothing is held, no byte counted
    assert (len(log), log.held_bytes) == (0, 0)


# -- the cancel stream -------------------------------------------------------------------------


@pytest.mark.parametrize("admission", ["functions", "scripts"])
async def test_cancel_appends_the_id_to_the_cancel_stream_with_a_ttl(
    redis_url: str, queue: str, rclient: redis.Redis, keys: QueueKeys, admission: str
) -> None:
    """With the functions the cancel goes to the inbox behind its request (a worker adds it
    to the cancel stream as it admits the inbox); with the script, to the stream."""
    async with AsyncProducer(
        redis_url=redis_url, queue=queue, result_ttl_s=300, admission=admission
    ) as producer:
        await check_a_cancel(producer, rclient, keys, admission)


async def check_a_cancel(
    producer: AsyncProducer, rclient: redis.Redis, keys: QueueKeys, admission: str
) -> None:
    handle = await producer.submit("nobody serves this queue")
    await producer.cancel(handle)
    await producer.cancel("someone-elses")
    if admission == "functions":
        elements = [msgpack.unpackb(e) for e in rclient.lrange(keys.inbox, 0, -1)]
        assert [e[0] for e in elements] == ["r", "c", "c"]
        assert [e[1] for e in elements[1:]] == [handle.id, "someone-elses"]
        assert rclient.xlen(keys.cancels) == 0
    else:
        ids = [fields[b"id"] for _entry, fields in rclient.xrange(keys.cancels)]
        assert ids == [handle.id.encode(), b"someone-elses"]
        assert 0 < rclient.ttl(keys.cancels) <= 300
    # This producer's own waiter learns at once, with a typed error.
    assert handle.id not in producer._waiting
    assert handle.id not in producer._waiting.inputs
    with pytest.raises(RequestCancelled):
        await producer.wait(handle, timeout_s=0)


async def test_catch_up_pages_through_more_than_a_thousand_ids(
    aclient: AsyncRedis, rclient: redis.Redis, keys: QueueKeys
) -> None:
    n = 2345
    with rclient.pipeline(transaction=False) as pipe:
        for i in range(n):
            pipe.xadd(keys.cancels, {"id": f"c{i}"})
        pipe.execute()
    log = CancelLog(3600)
    counting = CountingClient(aclient)
    await log.catch_up(counting, keys)
    assert len(log) == n
    assert all(f"c{i}" in log for i in range(n))
    assert counting.xreads == 3  # 1000 + 1000 + 345
    # Following resumes after the last id read: a new one is all it reads.
    await Admission(keys, "scripts").cancel(aclient, "new", ttl_s=3600)
    calls = 0

    def running() -> bool:
        nonlocal calls
        calls += 1
        return calls == 1  # one read, then stop

    await asyncio.wait_for(log.follow(counting, keys, running), T)
    assert counting.xreads == 4
    assert "new" in log
    assert len(log) == n + 1


async def test_catch_up_stops_at_exactly_a_thousand_ids(
    aclient: AsyncRedis, rclient: redis.Redis, keys: QueueKeys
) -> None:
    with rclient.pipeline(transaction=False) as pipe:
        for i in range(1000):
            pipe.xadd(keys.cancels, {"id": f"c{i}"})
        pipe.execute()
    log = CancelLog(3600)
    counting = CountingClient(aclient)
    await log.catch_up(counting, keys)
    assert len(log) == 1000
    assert counting.xreads == 2  # a full page, then an empty one


async def test_catch_up_skips_ids_older_than_the_ttl(
    aclient: AsyncRedis, rclient: redis.Redis, keys: QueueKeys
) -> None:
    now_ms = int(time.time() * 1e3)
    ttl_s = 60
    rclient.xadd(keys.cancels, {"id": "ancient"}, id=f"{now_ms - 3_600_000}-0")
    rclient.xadd(keys.cancels, {"id": "just-too-old"}, id=f"{now_ms - ttl_s * 1000 - 5000}-0")
    rclient.xadd(keys.cancels, {"id": "recent"}, id=f"{now_ms - ttl_s * 1000 + 5000}-0")
    rclient.xadd(keys.cancels, {"id": "new"})
    rclient.xadd(keys.cancels, {"other": "field"})  # no id: nothing to remember
    log = CancelLog(ttl_s)
    await log.catch_up(aclient, keys)
    assert ("ancient" in log, "just-too-old" in log) == (False, False)
    assert ("recent" in log, "new" in log) == (True, True)
    assert len(log) == 2


async def test_a_flood_of_junk_and_of_ids_stays_within_the_caps(
    aclient: AsyncRedis, keys: QueueKeys
) -> None:
    """Junk (4 KiB ids, no id, binary) is ignored; valid ids past max_ids evict the oldest.
    The worker holds at most max_ids ids, whatever the stream holds: at start-up it reads
    the newest max_ids entries only; following, it takes each new one."""
    async with aclient.pipeline(transaction=False) as pipe:
        for i in range(3000):
            pipe.xadd(keys.cancels, {"id": f"old-{i}"})
        await pipe.execute()
    log = CancelLog(3600, max_ids=1000)
    await log.catch_up(aclient, keys)
    assert (len(log), log.ignored, log.evicted) == (1000, 0, 0)
    assert ("old-1999" in log, "old-2000" in log) == (False, True)
    async with aclient.pipeline(transaction=False) as pipe:
        for i in range(500):
            pipe.xadd(keys.cancels, {"id": b"j" * 4096})
            pipe.xadd(keys.cancels, {"id": b"\xff\xfe" + str(i).encode()})
            pipe.xadd(keys.cancels, {"other": b"x"})
        for i in range(3000):
            pipe.xadd(keys.cancels, {"id": f"r-{i}"})
        await pipe.execute()
    reads = 0

    def running() -> bool:
        nonlocal reads
        reads += 1
        return reads <= 5  # 4,500 entries: five pages of 1000

    await asyncio.wait_for(log.follow(aclient, keys, running), T)
    assert (len(log), log.ignored, log.evicted) == (1000, 1500, 3000)
    assert "r-1999" not in log
    assert "r-2000" in log
    assert "r-2999" in log
    assert log.held_bytes <= 1000 * (6 + ID_OVERHEAD_BYTES)


async def test_start_up_reads_at_most_max_ids_entries_whatever_the_stream_holds(
    aclient: AsyncRedis, keys: QueueKeys
) -> None:
    """A worker's start-up does not grow with the cancel stream: 30,000 entries written
    around any cap, of which it reads the newest 2,000 (two pages)."""
    async with aclient.pipeline(transaction=False) as pipe:
        for i in range(30_000):
            pipe.xadd(keys.cancels, {"id": f"c{i}"} if i % 2 else {"junk": b"x"})
        await pipe.execute()
    log = CancelLog(3600, max_ids=2000)
    counting = CountingClient(aclient)
    await log.catch_up(counting, keys)
    assert (counting.xreads, counting.entries) == (2, 2000)
    assert (len(log), log.ignored) == (1000, 1000)
    assert "c29999" in log
    assert "c27999" not in log


def test_a_cancel_covers_only_the_entries_added_before_it() -> None:
    log = CancelLog(10, clock=FakeClock())
    log.add("r1", 5_000)
    assert log.covers("r1", b"4999-7")
    assert log.covers("r1", "5000-0")
    assert not log.covers("r1", b"5001-0")  # added after the cancel: a resubmit runs
    assert not log.covers("other", b"1-0")
    log.add("r2")  # a cancel of no particular time: every entry of the id
    assert log.covers("r2", b"99999999999999-0")


async def test_catch_up_on_a_queue_without_cancels(aclient: AsyncRedis, keys: QueueKeys) -> None:
    log = CancelLog(60)
    await log.catch_up(aclient, keys)
    assert len(log) == 0


@pytest.mark.slow
async def test_follow_reads_new_ids_until_told_to_stop(
    aclient: AsyncRedis, rclient: redis.Redis, keys: QueueKeys
) -> None:
    log = CancelLog(60)
    await log.catch_up(aclient, keys)
    stop = False
    follower = asyncio.create_task(log.follow(aclient, keys, lambda: not stop))
    try:
        for rid in ("x1", "x2"):
            rclient.xadd(keys.cancels, {"id": rid})
        deadline = time.monotonic() + T
        while len(log) < 2:
            assert time.monotonic() < deadline, "the follower never read the new ids"
            assert not follower.done(), follower
            await asyncio.sleep(0.01)
        assert ("x1" in log, "x2" in log) == (True, True)
    finally:
        stop = True
        await asyncio.wait_for(follower, T)  # ends after its current read (one block, 1 s)


# -- end to end --------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_request_cancelled_while_a_worker_holds_it_never_reaches_the_model(
    producer: AsyncProducer,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    gate = GatedModel()
    worker = start_worker(gate, batch_size=1, timeout_ms=HUGE_MS, read_ahead=4).worker
    first = await producer.submit("first")
    assert await asyncio.to_thread(gate.entered.wait, T), "no batch reached the model"
    doomed = await producer.submit("doomed")
    after = await producer.submit("after")
    # The worker has read both: they wait in its queue behind "first", which it runs.
    await asyncio.to_thread(
        wait_until, lambda: pending_count(rclient, keys) == 3, "the worker to hold all three"
    )
    assert doomed.id not in worker._parts.cancels
    await producer.cancel(doomed)
    await asyncio.to_thread(
        wait_until,
        lambda: doomed.id in worker._parts.cancels,
        "the cancellation to reach the worker",
    )
    assert gate.batches == [["first"]]  # nothing else has started yet
    gate.release.set()
    assert await producer.result(first, timeout_s=T) == "first"
    assert await producer.result(after, timeout_s=T) == "after"
    result = await poll_result(producer, doomed.id)
    assert (result.status, result.worker) == ("cancelled", worker.worker_id)
    assert gate.batches == [["first"], ["after"]]
    assert worker.counts["cancelled"] == 1
    assert worker.counts["ok"] == 2
    with pytest.raises(RequestCancelled):
        await producer.wait(doomed, timeout_s=0)
    await asyncio.to_thread(
        wait_until, lambda: pending_count(rclient, keys) == 0, "every entry acknowledged"
    )
    assert sum(int(rclient.xlen(s)) for s in keys.streams) == 0


@pytest.mark.slow
async def test_workers_trim_the_cancel_stream_however_it_was_written(
    aclient: AsyncRedis, rclient: redis.Redis, keys: QueueKeys
) -> None:
    """Written straight to the stream (the script's mode: producers add cancels themselves),
    150,000 entries, some older than the TTL: a worker's trim keeps about CANCELS_MAXLEN of
    them, none older than the TTL."""
    now_ms = int(time.time() * 1e3)
    with rclient.pipeline(transaction=False) as pipe:
        for i in range(1000):
            pipe.xadd(keys.cancels, {"id": f"old-{i}"}, id=f"{now_ms - 7_200_000 + i}-0")
        for i in range(150_000):
            pipe.xadd(keys.cancels, {"id": f"c{i}"})
        pipe.execute()
    trim = CancelTrim(aclient, keys, 3600)
    await trim.step()
    assert CANCELS_MAXLEN <= rclient.xlen(keys.cancels) <= CANCELS_MAXLEN + 1000
    oldest = rclient.xrange(keys.cancels, count=1)[0][1][b"id"]
    assert not oldest.startswith(b"old-")
    assert not trim.refused
