"""Answers computed once: a request id resubmitted (by this producer, by another, after a
crash) gets the one answer; an id reused for another input is refused.

Real Redis, real workers (a gated model in this process, whose batches the test sees)."""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis

from batchline.errors import RequestIdConflict
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer

from .conftest import (
    RESULT_TIMEOUT_S,
    WorkerProcess,
    WorkerThread,
    producer_reports,
    spec,
    start_producers,
    stop_producers,
    stream_lengths,
    wait_until,
)
from .models_for_tests import GatedModel, read_batches
from .reply_spy import count_replies

T = RESULT_TIMEOUT_S


@pytest.fixture
async def producers(redis_url: str, queue: str) -> AsyncIterator[list[AsyncProducer]]:
    """Two producers of the test's queue (two reply streams, as two processes have)."""
    async with (
        AsyncProducer(redis_url=redis_url, queue=queue) as a,
        AsyncProducer(redis_url=redis_url, queue=queue) as b,
    ):
        yield [a, b]


def entries_added(client: redis.Redis, keys: QueueKeys) -> list[int]:
    """How many entries each work stream has ever had added (XLEN falls as they are done)."""
    return [int(client.xinfo_stream(s)["entries-added"]) for s in keys.streams]


def computed(model: GatedModel) -> list[object]:
    """Every input the model has run, in order."""
    return [x for batch in model.batches for x in batch]


async def test_a_resubmitted_answered_id_gets_its_result_without_enqueueing(
    producers: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    a, b = producers
    model = GatedModel()
    model.release.set()
    start_worker(model=model)
    first = await a.wait(await a.submit("hello", request_id="r-1"), timeout_s=T)
    assert (first.status, first.output) == ("ok", "hello")
    added = entries_added(rclient, keys)
    for producer in (a, b):
        handle = await producer.submit("hello", request_id="r-1")
        assert handle._future is not None
        assert handle._future.done()
        again = await producer.wait(handle, timeout_s=T)
        assert again == first  # the stored result itself: same worker, same timings
        assert await producer.infer("hello", request_id="r-1", timeout_s=T) == "hello"
    assert entries_added(rclient, keys) == added
    assert computed(model) == ["hello"]
    assert a.counts["result"] == 2
    assert b.counts["result"] == 2
    assert rclient.hget(keys.once_stats, "existing") == b"4"


async def test_resubmits_while_queued_or_running_wait_for_the_one_answer(
    producers: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    a, b = producers
    replies = [count_replies(a), count_replies(b)]
    handles = [(a, await a.submit("x", request_id="one"))]
    # Queued, no worker yet: a resubmit from either producer attaches to it.
    handles += [(p, await p.submit("x", request_id="one")) for p in (a, b)]
    assert sum(stream_lengths(rclient, keys)) == 1
    model = GatedModel()
    start_worker(model=model, batch_size=1)
    assert model.entered.wait(T)
    assert computed(model) == ["x"]  # running now, held by the gate
    # Running: resubmits attach too, and a poller's (reply=False) reads the result key.
    handles += [(p, await p.submit("x", request_id="one")) for p in (b, a)]
    poller = await b.submit("x", request_id="one", reply=False)
    assert sum(stream_lengths(rclient, keys)) == 1  # nothing more was added
    model.release.set()
    for producer, handle in handles:
        result = await producer.wait(handle, timeout_s=T)
        assert (result.id, result.output) == ("one", "x")
    wait_until(lambda: rclient.exists(keys.result("one")), "the result key")
    found = await b.get_result(poller.id)
    assert found is not None
    assert found.output == "x"
    assert computed(model) == ["x"]  # computed once
    assert replies == [Counter(one=1), Counter(one=1)]  # one reply to each producer
    assert a.counts["attached"] == 2
    assert b.counts["attached"] == 3
    assert a._waiting == {}
    assert b._waiting == {}
    assert not rclient.exists(keys.waiters("one"))  # answered: the waiters' set is gone
    assert 0 < rclient.ttl(keys.request_input("one")) <= 3600


async def test_an_id_reused_for_another_input_is_refused(
    producers: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    a, b = producers
    handle = await a.submit({"text": "one"}, request_id="same")
    for producer in (a, b):
        with pytest.raises(RequestIdConflict, match="'same' was submitted before with another"):
            await producer.submit({"text": "two"}, request_id="same")
        with pytest.raises(RequestIdConflict):
            await producer.infer({"text": "two"}, request_id="same", timeout_s=T)
    assert sum(stream_lengths(rclient, keys)) == 1
    assert a._waiting.keys() == {"same"}
    assert b._waiting == {}
    model = GatedModel()
    model.release.set()
    start_worker(model=model)
    assert (await a.wait(handle, timeout_s=T)).output == {"text": "one"}
    with pytest.raises(RequestIdConflict):  # answered: still the same request's id
        await b.submit({"text": "two"}, request_id="same")
    # The same input in another order of keys is another encoding, hence another input.
    with pytest.raises(RequestIdConflict):
        await b.submit({"text": "one", "x": 1}, request_id="same")
    assert rclient.hget(keys.once_stats, "conflict") == b"6"


def test_producer_processes_resubmitting_the_same_ids_while_a_worker_dies(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    tmp_path: Path,
) -> None:
    n = 80
    records = [tmp_path / f"worker-{i}.jsonl" for i in range(2)]
    workers = [
        spawn_worker(
            spec("slow_double"),
            env={"BLTEST_SLOW_S": "0.05", "BLTEST_RECORD_FILE": str(record)},
            batch_size=4,
            claim_idle_ms=1000,
            max_restarts_per_min=0,  # the worker is the process: SIGKILL kills it
            ready=False,
        )
        for record in records
    ]
    for worker in workers:
        worker.wait_ready(rclient, keys)
    producers = start_producers(redis_url, queue, [["same", str(n), "shared"]] * 4)
    try:
        wait_until(lambda: len(read_batches(records[0])) >= 2, "the first worker's batches")
        workers[0].signal(signal.SIGKILL)
        assert workers[0].wait() == -signal.SIGKILL
        assert [r["wrong"] for r in producer_reports(producers)] == [[]] * 4
        workers[1].signal(signal.SIGTERM)
        assert workers[1].wait() == 0, workers[1].log()
        for report in producer_reports(producers, final=True):  # no reply can come now
            assert report == {**report, "left": 0, "missing": 0, "twice": {}, "strangers": []}
    finally:
        stop_producers(producers)
    started_by_the_dead = Counter(x for batch in read_batches(records[0]) for x in batch)
    runs = started_by_the_dead + Counter(x for batch in read_batches(records[1]) for x in batch)
    assert set(runs) == {f"same-{i}" for i in range(n)}  # every id computed
    twice = {x for x, k in runs.items() if k > 1}
    assert max(runs.values()) <= 2  # at most once more after the crash,
    assert twice <= set(started_by_the_dead)  # and only what the dead worker had started
    assert sum(stream_lengths(rclient, keys)) == 0
    assert rclient.xlen(keys.dead) == 0
