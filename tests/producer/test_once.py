"""Answers computed once: a request id resubmitted (by this producer, by another, after a
crash) gets the one answer; an id reused for another input is refused.

Real Redis, real workers (a gated model in this process, whose batches the test sees)."""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from batchline.config import WorkerSettings
from batchline.errors import QueueFull, RequestIdConflict
from batchline.keys import GROUP, QueueKeys
from batchline.producer import AsyncProducer
from batchline.transport import cache_hash, input_hash
from batchline.transport.status import collect, render
from batchline.worker.serving._answers import answer
from batchline.worker.serving._writer import AnswerCache
from batchline.worker.shared._held import Meta, Record

from tests.support.models_for_tests import GatedModel, poison, read_batches
from tests.support.reply_spy import count_replies
from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerProcess,
    WorkerThread,
    admit_inbox,
    admitted,
    producer_reports,
    spec,
    start_producers,
    stop_producers,
    stream_lengths,
    wait_until,
)

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


@pytest.mark.slow
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
    # Counted by the admission, from the notes the enqueue function appends.
    wait_until(lambda: admitted(rclient, keys), "the notes' admission")
    assert rclient.hget(keys.once_stats, "existing") == b"4"


@pytest.mark.slow
async def test_resubmits_while_queued_or_running_wait_for_the_one_answer(
    producers: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    a, b = producers
    replies = [count_replies(a), count_replies(b)]
    handles = [(a, await a.submit("x", request_id="one"))]
    admit_inbox(rclient, keys)  # as a worker would, none running yet
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
    wait_until(lambda: admitted(rclient, keys), "the resubmits' admission")
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


@pytest.mark.slow
async def test_an_id_reused_for_another_input_is_refused(
    producers: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    a, b = producers
    handle = await a.submit({"text": "one"}, request_id="same")
    admit_inbox(rclient, keys)  # as a worker would, none running yet
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
    # a's two conflicts were refused by a itself (it waits for that id): not sent. The
    # others are counted by the admission, from the notes the enqueue function appends.
    wait_until(lambda: admitted(rclient, keys), "the notes' admission")
    assert rclient.hget(keys.once_stats, "conflict") == b"4"


@pytest.mark.slow
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


# -- the result cache --------------------------------------------------------------------------


@pytest.fixture
async def cached(redis_url: str, queue: str) -> AsyncIterator[list[AsyncProducer]]:
    """Two producers of the test's queue with the cache on (60 s)."""
    async with (
        AsyncProducer(redis_url=redis_url, queue=queue, cache_ttl_s=60) as a,
        AsyncProducer(redis_url=redis_url, queue=queue, cache_ttl_s=60) as b,
    ):
        yield [a, b]


def queue_keys(client: redis.Redis, keys: QueueKeys, kind: str) -> list[bytes]:
    """The queue's keys of one kind (``cache``, ``flight``, ``wait``, ``rid``, ...)."""
    return sorted(client.scan_iter(match=f"{keys.base}:{kind}:*"))


@pytest.mark.slow
async def test_identical_inputs_are_coalesced_then_answered_from_the_cache(
    cached: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    redis_url: str,
) -> None:
    a, b = cached
    replies = [count_replies(a), count_replies(b)]
    model = GatedModel()
    worker = start_worker(model=model, cache_ttl_s=60, model_id="m1").worker
    first = await a.submit("same text")  # a miss: queued, marked in flight
    assert model.entered.wait(T)
    # The same input under other ids, while it runs: coalesced onto it, nothing queued.
    joined = [await p.submit("same text") for p in (a, b, b)]
    poller = await a.submit("same text", reply=False)
    other = await b.submit("other text")  # another input: a miss of its own
    wait_until(lambda: admitted(rclient, keys), "their admission")
    assert entries_added(rclient, keys) == [0, 2, 0]
    assert len(queue_keys(rclient, keys, "flight")) == 2
    model.release.set()
    for producer, handle in [(a, first), (a, joined[0]), (b, joined[1]), (b, joined[2])]:
        result = await producer.wait(handle, timeout_s=T)
        assert (result.id, result.status, result.output) == (handle.id, "ok", "same text")
    assert (await b.wait(other, timeout_s=T)).output == "other text"
    wait_until(lambda: rclient.exists(keys.result(poller.id)), "the poller's result key")
    polled = await a.get_result(poller.id)
    assert polled is not None
    assert (polled.id, polled.output) == (poller.id, "same text")
    assert replies == [
        Counter({first.id: 1, joined[0].id: 1}),
        Counter({joined[1].id: 1, joined[2].id: 1, other.id: 1}),
    ]
    # Answered: both inputs are cached; their in-flight marks and waiters are gone.
    assert len(queue_keys(rclient, keys, "cache")) == 2
    assert queue_keys(rclient, keys, "flight") == []
    assert queue_keys(rclient, keys, "wait") == []
    # Now a hit: answered at once, with its own id, from the cached bytes; nothing queued.
    hit = await b.submit("same text")
    assert hit._future is not None
    assert hit._future.done()
    result = await b.wait(hit, timeout_s=T)
    assert (result.id, result.output, result.worker) == (hit.id, "same text", worker.worker_id)
    assert await a.infer("same text", timeout_s=T) == "same text"
    assert await b.get_result(hit.id) == result  # a poller finds it through rid:<id>
    assert entries_added(rclient, keys) == [0, 2, 0]
    assert sorted(computed(model)) == ["other text", "same text"]  # each input once
    wait_until(lambda: admitted(rclient, keys), "the hits' notes")  # the admission counts
    figures = await a_status(a)
    assert {k: figures[k] for k in ("hit", "miss", "coalesced")} == {
        "hit": 2,
        "miss": 2,
        "coalesced": 4,
    }
    assert figures["hit_rate"] == 0.25
    assert (a.counts["cached"], b.counts["cached"], b.counts["coalesced"]) == (1, 1, 2)
    # A poller without the cache setting finds a hit's answer too; the id keeps its input
    # for result_ttl_s, as any id, not only as long as the cache entry.
    async with AsyncProducer(redis_url=redis_url, queue=keys.queue) as plain:
        assert plain.settings.cache_ttl_s == 0
        assert await plain.get_result(hit.id) == result
    assert rclient.ttl(keys.request_input(hit.id)) > 60


@pytest.mark.slow
async def test_only_ok_results_are_cached_and_every_new_key_expires(
    cached: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    a, _b = cached
    model = GatedModel(poison)
    model.release.set()
    start_worker(model=model, cache_ttl_s=60)
    for _ in range(2):  # an error is not cached: the same input runs again
        result = await a.wait(await a.submit("poison"), timeout_s=T)
        assert (result.status, result.error_type) == ("error", "ValueError")
    assert await a.infer("fine", timeout_s=T) == "fine"
    assert await a.infer("fine", timeout_s=T) == "fine"  # a hit
    assert computed(model).count("poison") == 2
    assert computed(model).count("fine") == 1
    cache = queue_keys(rclient, keys, "cache")
    assert len(cache) == 1
    assert 0 < rclient.ttl(cache[0]) <= 60
    # Every key this created expires; only the work streams (and the dead letters, none
    # here) live on.
    lasting = {k for k in rclient.scan_iter(match=f"{keys.base}:*") if rclient.ttl(k) == -1}
    # The functions' tag lasts too: producers need it while no worker runs (scaled to zero).
    assert lasting <= {s.encode() for s in [*keys.streams, keys.workers, keys.functions]}
    assert 0 < rclient.pttl(keys.model) <= 5000
    assert 0 < rclient.ttl(keys.once_stats) <= 3600


@pytest.mark.slow
async def test_a_worker_without_the_cache_does_not_fill_it(
    cached: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    a, _b = cached
    rclient.set(keys.model, "the-new-model", ex=60)  # published by another worker
    model = GatedModel()
    model.release.set()
    start_worker(model=model)  # its cache is off: it publishes and fills nothing
    assert await a.infer("text", timeout_s=T) == "text"
    assert await a.infer("text", timeout_s=T) == "text"
    assert computed(model) == ["text", "text"]  # a miss each time: not cached
    assert queue_keys(rclient, keys, "cache") == []
    assert queue_keys(rclient, keys, "flight") == []


@pytest.mark.parametrize("how", ["refused", "max_deliveries"])
@pytest.mark.slow
async def test_requests_coalesced_onto_a_dead_lettered_one_get_its_error(
    cached: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    how: str,
) -> None:
    a, b = cached
    rclient.set(keys.model, "m1", ex=60)  # as the worker below publishes it
    text = "a text longer than the refusing worker accepts"
    leader = await a.submit(text)  # queued with its cache hash, marked in flight
    admit_inbox(rclient, keys, cache_ttl_s=60)  # as a worker would, none running yet
    joined = await b.submit(text)  # the same input: coalesced onto it
    poller = await a.submit(text, reply=False)  # coalesced too, without a reply stream
    admit_inbox(rclient, keys, cache_ttl_s=60)
    assert (a.counts["coalesced"], b.counts["coalesced"]) == (1, 1)
    assert rclient.xlen(keys.stream(1)) == 1
    if how == "refused":  # the worker's limits refuse the entry: MalformedRequest
        kind, settings = "MalformedRequest", dict(max_chars=8)
    else:  # a worker read it and died: delivered too often, MaxDeliveries
        kind, settings = "MaxDeliveries", dict(max_deliveries=1, claim_idle_ms=100)
        rclient.xgroup_create(keys.stream(1), GROUP, id="0")
        assert rclient.xreadgroup(GROUP, "gone", {keys.stream(1): ">"}, count=1)
    start_worker(cache_ttl_s=60, model_id="m1", **settings)
    first = await a.wait(leader, timeout_s=T)
    assert (first.status, first.error_type) == ("error", kind)
    assert [d[1][b"id"] for d in rclient.xrange(keys.dead)] == [leader.id.encode()]
    # The members were answered in the same script call as their leader: stored already.
    assert rclient.exists(keys.result(joined.id), keys.result(poller.id)) == 2
    result = await b.wait(joined, timeout_s=T)
    assert (result.id, result.status, result.error_type) == (joined.id, "error", kind)
    polled = await a.get_result(poller.id)
    assert polled is not None
    assert (polled.id, polled.status, polled.error_type) == (poller.id, "error", kind)
    # Its in-flight mark and waiters are gone; an error fills no cache.
    for kind_of_key in ("flight", "wait", "cache"):
        assert queue_keys(rclient, keys, kind_of_key) == []
    # A later request of this input is queued, not coalesced onto the dead-lettered one.
    later = await b.submit(text)
    assert b.counts["coalesced"] == 1
    wait_until(lambda: admitted(rclient, keys), "its admission")
    assert entries_added(rclient, keys) == [0, 2, 0]
    again = await b.wait(later, timeout_s=T)
    if how == "refused":
        assert (again.status, again.error_type) == ("error", kind)
    else:
        assert (again.status, again.output) == ("ok", text)


async def a_status(producer: AsyncProducer) -> dict[str, float]:
    """The queue's counters as ``batchline status`` reports them."""
    figures = await collect(producer.settings, producer._redis)
    once = figures["once"]
    assert f"hit rate {once['hit_rate']:.1%}" in render(figures)
    return dict(once)


def test_a_worker_fills_the_cache_only_under_its_own_model_and_the_input_it_ran() -> None:
    cache = AnswerCache(WorkerSettings(cache_ttl_s=60, model_id="old"), None)
    meta = b'"text"'
    h = input_hash(meta, b"")

    def record(ck: str | None) -> Record:
        request: Any = {"v": 2, "id": "r", "meta": meta, **({"ck": ck} if ck else {})}
        return answer(Meta(0, b"1-0", request, "text", 0.0), "ok", "w", output="text")

    for model_id, fills in (("old", True), ("new", False)):
        key = cache_hash(model_id, h)
        filled, mark = cache.keys_for(record(key))
        assert record(key).input_hash == h
        assert mark == cache.keys.in_flight(key)  # cleared either way
        assert filled == (cache.keys.cache(key) if fills else "")
    lying = cache_hash("old", "0" * 40)  # a ck that is not this input's: never filled
    assert cache.keys_for(record(lying)) == ("", cache.keys.in_flight(lying))
    assert cache.keys_for(record(None)) == ("", "")  # no ck: nothing
    assert record(None).input_hash == ""


async def test_a_request_refused_as_the_queue_was_full_leaves_its_id_free(
    redis_url: str, queue: str, rclient: redis.Redis, keys: QueueKeys
) -> None:
    async with AsyncProducer(redis_url=redis_url, queue=queue, max_queue_depth=1) as producer:
        await producer.submit("first", request_id="in")
        with pytest.raises(QueueFull):
            await producer.submit("second", request_id="out")
        assert not rclient.exists(keys.request_input("out"))
        rclient.delete(*keys.streams, keys.inbox)  # room again
        again = await producer.submit("another input", request_id="out")  # no conflict
        assert again.id == "out"
        assert producer.counts == Counter(queued=2, full=1)
