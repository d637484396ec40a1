"""Producers and a worker on a real Redis: round trips, results and their keys, admission
control, deadlines, priorities, failing and malformed requests, cancellation, the CLI.

Workers run in this process here (a thread each); test_reliability.py runs them as processes.
Requests that must be waiting when a worker starts are submitted before it starts, so batches
form by size (``timeout_ms`` huge), never by a race with the clock.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from batchline.codec import SCHEMA_VERSION
from batchline.errors import (
    BatcherClosed,
    InferenceError,
    QueueFull,
    RequestCancelled,
    RequestExpired,
    RequestIdConflict,
    RequestTimeout,
)
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer, Producer

from tests.support.models_for_tests import GatedModel, double, read_batches
from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerThread,
    assert_same,
    pending_count,
    poll_result,
    queued,
    run_cli,
    spec,
    stream_lengths,
    wait_until,
)

T = RESULT_TIMEOUT_S
HUGE_MS = 600_000.0  # a batch timeout that never fires: batches flush by size
V = str(SCHEMA_VERSION)  # the schema version, as a field travels


@pytest.fixture
async def producer(redis_url: str, queue: str) -> AsyncIterator[AsyncProducer]:
    async with AsyncProducer(redis_url=redis_url, queue=queue) as p:
        yield p


@pytest.fixture
def record_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file record_batches writes each batch to (read with read_batches)."""
    path = tmp_path / "batches.jsonl"
    monkeypatch.setenv("BLTEST_RECORD_FILE", str(path))
    return path


def assert_queue_empty(client: redis.Redis, keys: QueueKeys) -> None:
    assert stream_lengths(client, keys) == [0] * keys.priorities
    assert pending_count(client, keys) == 0


# -- round trips -------------------------------------------------------------------------------


@pytest.mark.slow
async def test_infer_and_map_round_trip(
    producer: AsyncProducer, start_worker: Callable[..., WorkerThread]
) -> None:
    start_worker()
    assert await producer.infer("hello", timeout_s=T) == "hello"
    values = [
        "a text",
        ["two", "texts"],
        42,
        2.5,
        None,
        True,
        {"nested": [1, {"k": None}], "s": "ü"},
        np.arange(6, dtype=np.float32).reshape(2, 3),
        {"input_ids": np.arange(5, dtype=np.int64), "attention_mask": np.ones(5, np.int8)},
        [np.zeros(0, dtype=np.uint8), "mixed"],
    ]
    assert_same(await producer.map(values, timeout_s=T), values)
    result = await producer.wait(await producer.submit("x"), timeout_s=T)
    assert result.status == "ok"
    assert result.output == "x"
    assert result.batch_size >= 1


@pytest.mark.slow
def test_sync_producer_from_plain_threads(
    redis_url: str, queue: str, start_worker: Callable[..., WorkerThread]
) -> None:
    start_worker(spec("double"), batch_size=8)

    with Producer(redis_url=redis_url, queue=queue) as producer:

        def client(n: int) -> list[Any]:
            single = [producer.infer(n * 100 + i, timeout_s=T) for i in range(5)]
            many = producer.map([f"t{n}-{i}" for i in range(10)], timeout_s=T)
            return [single, many]

        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(client, range(8)))
        assert producer.queue_depth() == 0
    for n, (single, many) in enumerate(outcomes):
        assert single == [(n * 100 + i) * 2 for i in range(5)]
        assert many == [f"t{n}-{i}" * 2 for i in range(10)]


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
@pytest.mark.slow
def test_worker_and_producer_on_each_event_loop(
    redis_url: str, queue: str, spawn_worker: Callable[..., Any], event_loop: str
) -> None:
    if event_loop == "uvloop":
        pytest.importorskip("uvloop")
    worker = spawn_worker(spec("double"), event_loop=event_loop)
    with Producer(redis_url=redis_url, queue=queue, event_loop=event_loop) as producer:
        assert type(producer._loop).__module__.split(".")[0] == event_loop
        assert producer.map(list(range(40)), timeout_s=T) == [2 * i for i in range(40)]
    assert f"event loop {event_loop}" in worker.log()


@pytest.mark.slow
async def test_many_concurrent_submits_get_their_own_results_in_order(
    producer: AsyncProducer, start_worker: Callable[..., WorkerThread]
) -> None:
    start_worker(spec("double"), batch_size=16)
    values = list(range(400))
    handles = await asyncio.gather(*(producer.submit(v) for v in values))
    assert len({h.id for h in handles}) == len(values)
    results = await asyncio.gather(*(producer.result(h, timeout_s=T) for h in handles))
    assert results == double(values)


@pytest.mark.slow
async def test_results_are_stored_with_a_ttl_and_can_be_polled(
    producer: AsyncProducer,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    worker = start_worker(result_ttl_s=120).worker
    pushed = await producer.map([f"p{i}" for i in range(10)], timeout_s=T)
    assert pushed == [f"p{i}" for i in range(10)]
    polled = [await producer.submit(f"q{i}", reply=False) for i in range(10)]
    for i, handle in enumerate(polled):
        result = await poll_result(producer, handle.id)
        assert (result.status, result.output, result.worker) == ("ok", f"q{i}", worker.worker_id)
        assert (await producer.wait(handle.id)).output == f"q{i}"  # not ours: read from its key
    result_keys = list(rclient.scan_iter(match=f"{keys.base}:res:*"))
    assert len(result_keys) == 20
    for key in result_keys:
        assert 0 < rclient.ttl(key) <= 120, key
    assert 0 < rclient.ttl(keys.reply(producer.producer_id)) <= 120
    assert await producer.get_result("never-submitted") is None
    with pytest.raises(KeyError):
        await producer.wait("never-submitted")


@pytest.mark.slow
async def test_work_streams_are_empty_and_nothing_pending_after_the_work(
    producer: AsyncProducer,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    start_worker(batch_size=8)
    for priority in range(keys.priorities):
        values = [f"{priority}-{i}" for i in range(30)]
        assert await producer.map(values, priority=priority, timeout_s=T) == values
    assert_queue_empty(rclient, keys)
    assert await producer.queue_depth() == 0
    assert rclient.xlen(keys.dead) == 0


async def test_producer_argument_checks(producer: AsyncProducer) -> None:
    with pytest.raises(ValueError, match="request_id"):
        await producer.submit("x", request_id="no spaces")
    with pytest.raises(ValueError, match="priority"):
        await producer.submit("x", priority=3)
    with pytest.raises(TypeError):
        await producer.submit(object())
    handle = await producer.submit("nobody serves this queue", request_id="mine-1")
    assert handle.id == "mine-1"
    with pytest.raises(RequestTimeout):
        await producer.result(handle, timeout_s=0.05)
    # Its own id again with another input while the first still waits: refused (a
    # ValueError), the first waiter kept; with the same input it waits for the same answer.
    with pytest.raises(RequestIdConflict):
        await producer.submit("again", request_id="mine-1")
    with pytest.raises(RequestIdConflict):
        await producer.infer("again", request_id="mine-1")
    assert producer._waiting["mine-1"] == [handle._future]
    same = await producer.submit("nobody serves this queue", request_id="mine-1")
    assert producer._waiting["mine-1"] == [handle._future, same._future]
    await producer.cancel(handle)  # every waiter of the id here gets RequestCancelled
    with pytest.raises(RequestCancelled):
        await producer.result(same)
    assert "mine-1" not in producer._waiting
    await producer.aclose()
    with pytest.raises(BatcherClosed):
        await producer.submit("x")


# -- admission control -------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_full_queue_refuses_at_once_and_stores_nothing(
    redis_url: str,
    queue: str,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    async with AsyncProducer(redis_url=redis_url, queue=queue, max_queue_depth=5) as producer:
        handles = [await producer.submit(i, priority=i % 3) for i in range(5)]
        with pytest.raises(QueueFull, match="max_queue_depth=5"):
            await producer.submit(5)
        assert queued(rclient, keys) == 5
        assert await producer.queue_depth() == 5
        # Concurrent submits are coalesced into one script call: each is checked alone.
        late = await asyncio.gather(
            *(producer.submit(i) for i in range(10)), return_exceptions=True
        )
        assert all(isinstance(x, QueueFull) for x in late), late
        assert queued(rclient, keys) == 5
        start_worker()
        assert [await producer.result(h, timeout_s=T) for h in handles] == list(range(5))
        assert await producer.infer("room again", timeout_s=T) == "room again"


async def test_concurrent_submits_fill_the_queue_exactly(
    redis_url: str, queue: str, rclient: redis.Redis, keys: QueueKeys
) -> None:
    async with AsyncProducer(redis_url=redis_url, queue=queue, max_queue_depth=7) as producer:
        outcomes = await asyncio.gather(
            *(producer.submit(i) for i in range(20)), return_exceptions=True
        )
    accepted = [x for x in outcomes if not isinstance(x, BaseException)]
    refused = [x for x in outcomes if isinstance(x, BaseException)]
    assert len(accepted) == 7
    assert len(refused) == 13
    assert all(isinstance(x, QueueFull) for x in refused)
    assert queued(rclient, keys) == 7


# -- deadlines ---------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_request_past_its_deadline_is_expired_not_run(
    producer: AsyncProducer, start_worker: Callable[..., WorkerThread], record_file: Path
) -> None:
    submitted_ms = time.time() * 1e3
    late = await producer.submit("late", deadline_ms=1)
    fresh = await producer.submit("fresh")  # no deadline
    wait_until(lambda: time.time() * 1e3 > submitted_ms + 50, "the deadline to pass")
    worker = start_worker(spec("record_batches")).worker
    assert await producer.result(fresh, timeout_s=T) == "fresh"
    result = await producer.wait(late, timeout_s=T)
    assert result.status == "expired"
    assert result.worker == worker.worker_id
    with pytest.raises(RequestExpired):
        await producer.result(late, timeout_s=T)
    assert "late" not in [x for batch in read_batches(record_file) for x in batch]


@pytest.mark.slow
async def test_a_deadline_that_passes_while_queued_in_the_worker(
    producer: AsyncProducer, start_worker: Callable[..., WorkerThread]
) -> None:
    gate = GatedModel()
    # batch_size=2 and no batch timeout: "first" runs alone at once, and "queued" waits in the
    # worker's queue (a partial batch waits for the model to be free) until its deadline.
    start_worker(gate, batch_size=2, timeout_ms=0)
    first = await producer.submit("first")
    assert await asyncio.to_thread(gate.entered.wait, T)  # the model holds "first"
    queued = await producer.submit("queued", deadline_ms=100)
    deadline_ms = time.time() * 1e3 + 100
    wait_until(lambda: time.time() * 1e3 > deadline_ms + 50, "the deadline to pass")
    gate.release.set()
    assert await producer.result(first, timeout_s=T) == "first"
    assert (await producer.wait(queued, timeout_s=T)).status == "expired"
    assert gate.batches == [["first"]]


# -- priorities --------------------------------------------------------------------------------


@pytest.mark.slow
async def test_higher_priority_requests_run_first(
    producer: AsyncProducer, start_worker: Callable[..., WorkerThread], record_file: Path
) -> None:
    low = [await producer.submit(f"low-{i}", priority=0) for i in range(6)]
    high = [await producer.submit(f"high-{i}", priority=2) for i in range(2)]
    start_worker(spec("record_batches"), batch_size=1, timeout_ms=HUGE_MS)
    for handle in low + high:
        await producer.result(handle, timeout_s=T)
    order = [x for batch in read_batches(record_file) for x in batch]
    assert order[:2] == ["high-0", "high-1"]
    assert sorted(order) == sorted([f"low-{i}" for i in range(6)] + ["high-0", "high-1"])
    assert [x for x in order if x.startswith("low")] == [f"low-{i}" for i in range(6)]


async def test_a_backlog_read_ahead_never_delays_a_higher_priority_request_past_the_next_batch(
    producer: AsyncProducer,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    # The worker holds a backlog of low-priority requests, read long before a higher one
    # comes (past the overtaking bound of 100 ms a level): the higher one still joins the
    # very next batch after the call under way, however long that call and the wait were.
    # 39 of them and the high one: ten full batches (no batch timeout).
    low = [await producer.submit(f"low-{i}", priority=0) for i in range(39)]
    gate = GatedModel()
    start_worker(gate, batch_size=4, timeout_ms=HUGE_MS)
    assert await asyncio.to_thread(gate.entered.wait, T)  # the model holds the first batch
    wait_until(lambda: pending_count(rclient, keys) == 39, "the backlog read ahead")
    read = time.monotonic()
    wait_until(lambda: time.monotonic() > read + 0.3, "the backlog to pass the bound")
    high = await producer.submit("high", priority=1)
    wait_until(lambda: pending_count(rclient, keys) == 40, "the high request read")
    gate.release.set()
    assert await producer.result(high, timeout_s=T) == "high"
    lows = [await producer.result(handle, timeout_s=T) for handle in low]
    assert gate.batches[0] == ["low-0", "low-1", "low-2", "low-3"]
    assert gate.batches[1][0] == "high", gate.batches[:3]
    assert sorted(x for b in gate.batches for x in b) == sorted(["high", *map(str, lows)])


# -- failures ----------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_poisonous_input_fails_only_its_own_request(
    producer: AsyncProducer, start_worker: Callable[..., WorkerThread]
) -> None:
    values = ["a", "b", "poison", "c", "d"]
    handles = [await producer.submit(v) for v in values]
    start_worker(spec("poison"), batch_size=5, timeout_ms=HUGE_MS)
    results = [await producer.wait(h, timeout_s=T) for h in handles]
    assert [r.batch_size for r in results] == [5] * 5  # all five were in one batch
    for value, result in zip(values, results, strict=True):
        if value == "poison":
            assert (result.status, result.error_type) == ("error", "ValueError")
            assert "poisoned input" in result.error_message
        else:
            assert (result.status, result.output) == ("ok", value)
    with pytest.raises(InferenceError) as info:
        await producer.result(handles[2])
    assert info.value.error_type == "ValueError"


@pytest.mark.slow
async def test_a_model_output_of_the_wrong_length_fails_its_batch(
    producer: AsyncProducer, start_worker: Callable[..., WorkerThread]
) -> None:
    handles = [await producer.submit(v) for v in ("a", "b", "c")]
    start_worker(spec("wrong_length"), batch_size=3, timeout_ms=HUGE_MS)
    for handle in handles:
        with pytest.raises(InferenceError, match="2 results for 3 inputs") as info:
            await producer.result(handle, timeout_s=T)
        assert info.value.error_type == "BatchFunctionError"


@pytest.mark.slow
async def test_an_output_that_cannot_travel_is_an_error_result(
    producer: AsyncProducer, start_worker: Callable[..., WorkerThread]
) -> None:
    start_worker(spec("not_serializable"))
    with pytest.raises(InferenceError) as info:
        await producer.infer("x", timeout_s=T)
    assert info.value.error_type == "TypeError"


def garbage_entries(reply: str) -> dict[str, dict[str, Any]]:
    """Malformed work-stream entries, by the request id a worker can salvage (or a label)."""
    tag = uuid.uuid4().hex[:8]
    return {
        f"nometa-{tag}": {"v": V, "id": f"nometa-{tag}", "reply": reply},
        f"notjson-{tag}": {"v": V, "id": f"notjson-{tag}", "reply": reply, "meta": "{nope"},
        f"version-{tag}": {"v": str(SCHEMA_VERSION + 1), "id": f"version-{tag}", "meta": "1"},
        f"dtype-{tag}": {"v": V, "id": f"dtype-{tag}", "meta": '{"$nd": [["<f4"], [1], 0]}'},
        f"shape-{tag}": {
            "v": V,
            "id": f"shape-{tag}",
            "meta": '{"$nd": ["<f4", [0, 1000000000000000000000000000000], 0]}',
        },
        f"huge-{tag}": {
            "v": V,
            "id": f"huge-{tag}",
            "meta": '{"$nd": ["<f8", [1000000000000], 0]}',
            "blob": b"\0\0\0\0",
        },
        f"pickle-{tag}": {"v": V, "id": f"pickle-{tag}", "meta": '{"$nd": ["|O", [1], 0]}'},
        "(no id)": {"junk": "1"},
        "(bad id)": {"v": V, "id": "not a valid id", "meta": "1"},
        "(binary id)": {"v": V, "id": b"\xff\xfe", "meta": "1"},
    }


@pytest.mark.slow
async def test_malformed_entries_are_dead_lettered_and_the_worker_carries_on(
    producer: AsyncProducer,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    worker = start_worker()
    assert await producer.infer("before", timeout_s=T) == "before"
    garbage = garbage_entries(producer.producer_id)
    for fields in garbage.values():
        rclient.xadd(keys.stream(1), fields)
    # Entries are answered in the order they are read, so once a request written after the
    # garbage has its result, every garbage entry has been answered too.
    assert await producer.infer("after", priority=1, timeout_s=T) == "after"
    assert worker.alive
    dead = rclient.xrange(keys.dead)
    assert len(dead) == len(garbage)
    for _entry, fields in dead:
        assert fields[b"reason"].startswith(b"MalformedRequest: ")
        assert fields[b"worker"] == worker.worker.worker_id.encode()
    for request_id in (k for k in garbage if not k.startswith("(")):
        result = await producer.get_result(request_id)
        assert result is not None, request_id
        assert (result.status, result.error_type) == ("error", "MalformedRequest")
        with pytest.raises(InferenceError, match="MalformedRequest"):
            await producer.result(request_id)
    assert_queue_empty(rclient, keys)
    assert worker.worker.counts["dead"] == len(garbage)


# -- cancellation ------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_cancelled_request_never_reaches_the_model(
    producer: AsyncProducer,
    start_worker: Callable[..., WorkerThread],
    record_file: Path,
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    before = await producer.submit("before")
    doomed = await producer.submit("doomed")
    after = await producer.submit("after")
    await producer.cancel(doomed)
    start_worker(spec("record_batches"), batch_size=1, timeout_ms=HUGE_MS)
    assert await producer.result(before, timeout_s=T) == "before"
    assert await producer.result(after, timeout_s=T) == "after"
    result = await poll_result(producer, doomed.id)
    assert result.status == "cancelled"
    with pytest.raises(RequestCancelled, match="cancelled"):
        result.unwrap()
    with pytest.raises(RequestCancelled):  # a typed error, not the waiter's own cancellation
        await producer.wait(doomed, timeout_s=T)
    seen = [x for batch in read_batches(record_file) for x in batch]
    assert "doomed" not in seen
    assert sorted(seen) == ["after", "before"]
    assert_queue_empty(rclient, keys)


# -- the command line --------------------------------------------------------------------------


@pytest.mark.slow
async def test_status_shows_depth_dead_letters_and_live_workers(
    producer: AsyncProducer,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    redis_url: str,
    queue: str,
) -> None:
    gate = GatedModel()
    worker = start_worker(gate, batch_size=2, timeout_ms=HUGE_MS, heartbeat_s=0.2).worker
    rclient.xadd(keys.stream(0), {"junk": "1"})
    handles = [await producer.submit(i, priority=1) for i in range(4)]  # two full batches
    assert await asyncio.to_thread(gate.entered.wait, T), "no batch reached the model"
    wait_until(lambda: rclient.xlen(keys.dead) == 1, "the dead letter")
    wait_until(lambda: pending_count(rclient, keys) == 4, "the worker to hold 4 requests")
    wait_until(lambda: rclient.zscore(keys.workers, worker.worker_id), "a heartbeat")
    env = {"BATCHLINE_REDIS_URL": redis_url, "BATCHLINE_QUEUE": queue}
    done = run_cli("status", "--json", env=env)
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert (status["queue"], status["depth"], status["dead_letters"]) == (queue, 4, 1)
    by_priority = {s["priority"]: s for s in status["streams"]}
    assert by_priority[1]["length"] == 4
    assert by_priority[1]["pending"] == 4
    assert by_priority[1]["consumers"] == 1
    assert [w["worker"] for w in status["workers"]] == [worker.worker_id]
    assert status["workers"][0]["batch_size"] == 2
    text = run_cli("status", env=env)
    assert text.returncode == 0, text.stderr
    assert "depth 4" in text.stdout
    assert "dead letters 1" in text.stdout
    assert worker.worker_id in text.stdout
    gate.release.set()
    assert [await producer.result(h, timeout_s=T) for h in handles] == [0, 1, 2, 3]
    done = run_cli("status", "--json", env=env)
    assert json.loads(done.stdout)["depth"] == 0


@pytest.mark.slow
def test_worker_check_is_healthy_only_while_that_worker_runs(
    redis_url: str, queue: str, start_worker: Callable[..., WorkerThread], rclient: redis.Redis
) -> None:
    keys = QueueKeys(queue)
    worker_id = f"check-{uuid.uuid4().hex[:8]}-10"
    args = ["worker", "--check", "--redis-url", redis_url, "--queue", queue]
    assert run_cli(*args, "--worker-id", worker_id).returncode == 1  # none yet
    thread = start_worker(worker_id=worker_id)
    wait_until(lambda: rclient.zscore(keys.workers, worker_id), "a heartbeat")
    healthy = run_cli(*args, "--worker-id", worker_id)
    assert healthy.returncode == 0, healthy.stderr
    assert worker_id in healthy.stdout
    assert run_cli(*args, "--worker-id", worker_id[:-1]).returncode == 1  # "...-1" is not it
    assert run_cli(*args, "--worker-id", "someone-else").returncode == 1
    thread.stop()  # a stopping worker takes itself off the list
    unhealthy = run_cli(*args, "--worker-id", worker_id)
    assert unhealthy.returncode == 1
    assert "unhealthy" in unhealthy.stderr


@pytest.mark.slow
def test_worker_check_without_an_id_looks_for_this_host(
    redis_url: str, queue: str, start_worker: Callable[..., WorkerThread], rclient: redis.Redis
) -> None:
    keys = QueueKeys(queue)
    args = ["worker", "--check", "--redis-url", redis_url, "--queue", queue]
    assert run_cli(*args).returncode == 1
    worker = start_worker().worker  # default id: <host>-<pid>-<random>
    wait_until(lambda: rclient.zscore(keys.workers, worker.worker_id), "a heartbeat")
    assert run_cli(*args).returncode == 0
    assert run_cli(*args, "--redis-url", "redis://127.0.0.1:1/0").returncode == 1


@pytest.mark.parametrize("when", ["before the thread starts", "as the thread starts"])
def test_a_stop_before_run_has_its_loop_ends_the_worker_when_it_starts(
    redis_url: str, queue: str, when: str
) -> None:
    """``stop()`` that comes before ``run()`` has made its event loop is not lost: the run
    returns as soon as it starts (stopped before the thread starts: that case for sure)."""
    import threading

    from batchline.worker import Worker

    worker = Worker(model="batchline.worker.models:echo", redis_url=redis_url, queue=queue)
    thread = threading.Thread(target=asyncio.run, args=(worker.run(),), daemon=True)
    if when == "before the thread starts":
        worker.stop()
        thread.start()
        thread.join(10)
        assert not worker.ready.is_set()  # it never served
    else:
        thread.start()
        worker.stop()
    thread.join(10)
    try:
        assert not thread.is_alive()
    finally:
        if thread.is_alive():  # (the failure above: stop it now that its loop runs)
            worker.stop()
            thread.join(10)


def test_a_worker_run_a_second_time_says_so(redis_url: str, queue: str) -> None:
    """A stopped worker's parts are closed: a second ``run()`` is a clear error, not a
    worker that returns at once or serves with closed parts."""
    from batchline.worker import Worker

    worker = Worker(model="batchline.worker.models:echo", redis_url=redis_url, queue=queue)
    worker.stop()
    asyncio.run(worker.run())
    with pytest.raises(RuntimeError, match="runs once"):
        asyncio.run(worker.run())


# -- settings given in code --------------------------------------------------------------------


def test_an_unknown_variable_stops_a_producer_or_worker_that_reads_the_environment(
    redis_url: str, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A misspelled variable (``QEUE``) is an error at once, not requests sent to the
    queue ``default``; with a settings object given, the caller made them."""
    from batchline.config import ProducerSettings
    from batchline.worker import Worker

    monkeypatch.setenv("BATCHLINE_QEUE", queue)
    echo = "batchline.worker.models:echo"
    unknown = r"unknown setting\(s\) BATCHLINE_QEUE; known: "
    with pytest.raises(ValueError, match=unknown):
        AsyncProducer(redis_url=redis_url)
    with pytest.raises(ValueError, match=unknown):
        Producer(redis_url=redis_url)
    with pytest.raises(ValueError, match=unknown):
        Worker(model=echo, redis_url=redis_url)
    settings = ProducerSettings(redis_url=redis_url, queue=queue)
    with Producer(settings) as producer:
        assert producer.settings is settings
        assert producer.queue_depth() == 0


async def test_single_settings_beside_a_settings_object_are_refused(
    redis_url: str, queue: str
) -> None:
    """Both a settings object and single settings: a TypeError naming the single ones, as
    ``create_app`` says, rather than one of them dropped."""
    from batchline.config import ProducerSettings, WorkerSettings
    from batchline.worker import Worker

    producing = ProducerSettings(redis_url=redis_url, queue=queue)
    both = r"give settings or single settings, not both: \['max_queue_depth', 'queue'\]"
    with pytest.raises(TypeError, match=both):
        AsyncProducer(producing, queue="embed", max_queue_depth=5)
    with pytest.raises(TypeError, match=both):
        Producer(producing, queue="embed", max_queue_depth=5)
    serving = WorkerSettings(redis_url=redis_url, queue=queue)
    with pytest.raises(TypeError, match=r"not both: \['batch_size'\]"):
        Worker(serving, batch_size=64)
    with pytest.raises(TypeError, match=r"not both: \['model'\]"):  # a spec is a setting
        Worker(serving, model="batchline.worker.models:echo")
    async with AsyncProducer(producing) as producer:
        assert (producer.settings.queue, await producer.queue_depth()) == (queue, 0)
