"""How results come back to a producer: one reply entry per producer per completion, read
by the producer's reply reader, which drops what is malformed and carries on; and how
``infer`` waits on its result alone (refused, failed, timed-out and cancelled calls).

Where a test needs results to arrive in a given order, or malformed, it pushes reply
entries by hand onto the producer's reply stream, as the completion script would (the
protocol in docs/protocol.md), instead of racing a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import pickle
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import msgpack
import pytest
import redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import ConnectionError as RedisConnectionError

from batchline.codec import (
    SCHEMA_VERSION,
    DecodeError,
    Limits,
    Result,
    decode_request,
    decode_result,
    encode_request,
    pack_value,
    request_value,
    unpack_result,
)
from batchline.errors import (
    EnqueueTimeout,
    EnqueueUncertain,
    QueueFull,
    RequestTimeout,
    ServiceUnavailable,
)
from batchline.keys import GROUP, QueueKeys
from batchline.producer import AsyncProducer
from batchline.producer._replies import Waiters
from batchline.transport._redis import Backoff, Script
from batchline.transport._scripts import COMPLETE

from .conftest import RESULT_TIMEOUT_S, WorkerThread, pending_count, stream_lengths, wait_until
from .models_for_tests import GatedModel

T = RESULT_TIMEOUT_S
HUGE_MS = 600_000.0  # a batch timeout that never fires: batches flush by size
PRODUCER_LOGGER = "batchline.producer._replies"
DROPPED = "dropped a malformed reply"


@pytest.fixture
async def producer(redis_url: str, queue: str) -> AsyncIterator[AsyncProducer]:
    async with AsyncProducer(redis_url=redis_url, queue=queue) as p:
        yield p


# -- helpers -----------------------------------------------------------------------------------


def flat(result: Result, **changed: Any) -> list[Any]:
    """One result as a reply entry carries it (docs/protocol.md): a flat [field, value, ...]
    list; ``changed`` replaces field values (to make it malformed)."""
    meta, blob = pack_value(result.output) if result.status == "ok" else (b"null", b"")
    fields: dict[str, Any] = {
        "v": str(SCHEMA_VERSION),
        "id": result.id,
        "status": result.status,
        "meta": meta,
        "blob": blob,
        "etype": result.error_type,
        "emsg": result.error_message,
        "queue_ms": f"{result.queue_ms:.3f}",
        "batch": str(result.batch_size),
        "model_ms": f"{result.model_ms:.3f}",
        "worker": result.worker,
    }
    fields.update(changed)
    return [x for kv in fields.items() for x in kv]


def packed(result: Result) -> bytes:
    """One result as the completion script takes it and as its result key holds it."""
    return msgpack.packb(flat(result), use_bin_type=False)


def packed_with(result: Result, **changed: Any) -> bytes:
    """:func:`packed` with field values replaced (to make it malformed)."""
    return msgpack.packb(flat(result, **changed), use_bin_type=False)


def complete_args(keys: QueueKeys, records: list[Any]) -> list[Any]:
    """The completion script's ARGV for these records (TTL 60 s, caps of 1000); the script
    takes them one after another in one array."""
    packed_records = msgpack.packb([f for record in records for f in record], use_bin_type=False)
    prefixes = [keys.result_prefix, keys.reply_prefix, packed_records]
    return [GROUP, 60, 1000, 1000, *prefixes, keys.request_input(""), keys.waiters(""), 0]


def push_reply(client: redis.Redis, keys: QueueKeys, producer_id: str, results: list[Any]) -> None:
    """Add one reply entry by hand, as the completion script does (``results``: flat lists,
    or anything else a test wants the reader to face)."""
    packed = msgpack.packb(results, use_bin_type=False)
    client.xadd(keys.reply(producer_id), {"n": len(results), "r": packed})


def reply_entries(client: redis.Redis, key: str) -> list[tuple[int, list[Result]]]:
    """Every entry of a reply stream, oldest first: (its n, its decoded results)."""
    out = []
    for _entry, fields in client.xrange(key):
        flats = msgpack.unpackb(fields[b"r"], raw=True, use_list=True)
        results = [decode_result(dict(zip(f[::2], f[1::2], strict=True)), Limits()) for f in flats]
        out.append((int(fields[b"n"]), results))
    return out


def enqueue(
    client: redis.Redis, keys: QueueKeys, value: Any, request_id: str, reply: str | None
) -> None:
    """Add one request to the lowest work stream directly, for a reply stream nobody reads."""
    fields = encode_request(request_id, value, enqueued_unix_ms=time.time() * 1e3, reply=reply)
    client.xadd(keys.stream(0), fields)  # type: ignore[arg-type]


async def eventually(check: Callable[[], Any], what: str, *, timeout_s: float = T) -> Any:
    """Await until ``check()`` (a value or an awaitable) is truthy, without blocking the loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


async def depth_is(producer: AsyncProducer, n: int) -> bool:
    return await producer.queue_depth() == n


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Tripwire:
    """Pickles to a call of ``_trip``: if anything ever unpickled a reply, ``TRIPPED`` says so."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_trip, ())


TRIPPED: list[bool] = []


def _trip() -> None:
    TRIPPED.append(True)


# -- one reply entry per producer per completion ------------------------------------------------


def test_a_batch_from_one_producer_is_answered_with_one_reply_entry(
    start_worker: Callable[..., WorkerThread], rclient: redis.Redis, keys: QueueKeys
) -> None:
    watcher = f"watcher-{uuid.uuid4().hex[:8]}"  # a producer id whose stream nobody reads
    values = {f"r{i}": f"value-{i}" for i in range(5)}
    for rid, value in values.items():
        enqueue(rclient, keys, value, rid, watcher)
    start_worker(batch_size=5, timeout_ms=HUGE_MS)
    # The script deletes the entries in the step that pushes the replies.
    wait_until(lambda: sum(stream_lengths(rclient, keys)) == 0, "the batch to be answered")
    entries = reply_entries(rclient, keys.reply(watcher))
    assert len(entries) == 1, entries
    n, results = entries[0]
    assert n == 5
    assert {r.id: r.output for r in results} == values
    assert all((r.status, r.batch_size) == ("ok", 5) for r in results)
    assert pending_count(rclient, keys) == 0


def test_two_producers_in_one_batch_get_one_reply_entry_each(
    start_worker: Callable[..., WorkerThread], rclient: redis.Redis, keys: QueueKeys
) -> None:
    tag = uuid.uuid4().hex[:8]
    pa, pb = f"pa-{tag}", f"pb-{tag}"
    plan = [("a1", pa), ("b1", pb), ("a2", pa), ("nobody", None), ("a3", pa), ("b2", pb)]
    for rid, reply in plan:
        enqueue(rclient, keys, rid.upper(), rid, reply)
    start_worker(batch_size=len(plan), timeout_ms=HUGE_MS)
    wait_until(lambda: sum(stream_lengths(rclient, keys)) == 0, "the batch to be answered")
    for producer_id, want in ((pa, {"a1", "a2", "a3"}), (pb, {"b1", "b2"})):
        entries = reply_entries(rclient, keys.reply(producer_id))
        assert len(entries) == 1, (producer_id, entries)
        n, results = entries[0]
        assert n == len(want)
        assert {r.id for r in results} == want
        assert all(r.output == r.id.upper() and r.batch_size == len(plan) for r in results)
    # The request without a reply address has only its result key.
    assert sorted(rclient.scan_iter(match=f"{keys.base}:reply:*")) == sorted(
        [keys.reply(pa).encode(), keys.reply(pb).encode()]
    )
    assert unpack_result(rclient.get(keys.result("nobody")), Limits()).status == "ok"


async def test_a_producer_reads_a_whole_batch_from_one_reply_entry(
    producer: AsyncProducer,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    entries: list[int] = []  # per reply entry the reader handled: how many results it held
    deliver_all = producer._replies.deliver_all

    def spy(raw: dict[bytes, bytes]) -> None:  # a spy on a private method: what arrives
        entries.append(len(msgpack.unpackb(raw[b"r"], raw=True)))
        deliver_all(raw)

    producer._replies.deliver_all = spy  # type: ignore[method-assign]
    handles = [await producer.submit(f"v{i}") for i in range(6)]
    start_worker(batch_size=6, timeout_ms=HUGE_MS)
    assert [await producer.result(h, timeout_s=T) for h in handles] == [f"v{i}" for i in range(6)]
    assert entries == [6]
    assert producer._waiting == {}
    # The reader deletes what it read.
    reply_key = keys.reply(producer.producer_id)
    await eventually(lambda: rclient.xlen(reply_key) == 0, "the reader to delete what it read")


async def test_the_completion_script_answers_each_entry_once(
    redis_url: str, rclient: redis.Redis, keys: QueueKeys
) -> None:
    streams = [keys.stream(p) for p in range(keys.priorities)]
    for stream in streams:
        rclient.xgroup_create(stream, GROUP, id="0", mkstream=True)
    entry = {rid: rclient.xadd(keys.stream(1), {"id": rid}) for rid in ("a1", "b1", "a2", "q")}
    junk = rclient.xadd(keys.stream(0), {"junk": "1"})
    rclient.xreadgroup(GROUP, "c1", {s: ">" for s in streams})
    assert pending_count(rclient, keys) == 5
    records = [
        [1, entry["a1"], "a1", "pa", packed(Result("a1", "ok", "A1")), 0],
        [1, entry["b1"], "b1", "pb", packed(Result("b1", "ok", [1, 2])), 0],
        [1, entry["a2"], "a2", "pa", packed(Result("a2", "error", None, "E", "it failed")), 0],
        [1, entry["q"], "q", "", packed(Result("q", "ok", "Q")), 0],  # no reply address
        [0, junk, "", "", "", 0],  # acknowledged only
    ]
    args = complete_args(keys, records)
    script = Script(COMPLETE)
    client = AsyncRedis.from_url(redis_url)
    try:
        assert await script(client, [*streams, keys.dead], args) == 5
        # Again (as after a reclaim raced this answer): nothing acknowledged, nothing pushed.
        assert await script(client, [*streams, keys.dead], args) == 0
    finally:
        await client.aclose()
    [(n, results)] = reply_entries(rclient, keys.reply("pa"))
    assert n == 2
    assert [(r.id, r.status, r.output) for r in results] == [
        ("a1", "ok", "A1"),
        ("a2", "error", None),
    ]
    [(n, results)] = reply_entries(rclient, keys.reply("pb"))
    assert (n, [(r.id, r.output) for r in results]) == (1, [("b1", [1, 2])])
    assert len(list(rclient.scan_iter(match=f"{keys.base}:reply:*"))) == 2
    for rid in ("a1", "b1", "a2", "q"):
        assert 0 < rclient.ttl(keys.result(rid)) <= 60, rid
    stored = {rid: unpack_result(rclient.get(keys.result(rid)), Limits()) for rid in ("a2", "q")}
    assert (stored["a2"].status, stored["a2"].error_message) == ("error", "it failed")
    assert (stored["q"].status, stored["q"].output) == ("ok", "Q")
    assert 0 < rclient.ttl(keys.reply("pa")) <= 60
    assert stream_lengths(rclient, keys) == [0] * keys.priorities
    assert pending_count(rclient, keys) == 0
    assert rclient.xlen(keys.dead) == 0


async def test_the_completion_script_takes_a_write_of_ten_thousand_records(
    redis_url: str, rclient: redis.Redis, keys: QueueKeys
) -> None:
    n = 10_000  # a worker writes everything answered while its previous write was in flight
    streams = [keys.stream(p) for p in range(keys.priorities)]
    for stream in streams:
        rclient.xgroup_create(stream, GROUP, id="0", mkstream=True)
    with rclient.pipeline(transaction=False) as pipe:
        for i in range(n):
            pipe.xadd(keys.stream(0), {"id": f"r{i}"})
        entries = pipe.execute()
    rclient.xreadgroup(GROUP, "c1", {keys.stream(0): ">"}, count=n)
    records = [
        [0, entry, f"r{i}", "pa", packed(Result(f"r{i}", "ok", i)), 0]
        for i, entry in enumerate(entries)
    ]
    args = complete_args(keys, records)
    client = AsyncRedis.from_url(redis_url)
    try:
        assert await Script(COMPLETE)(client, [*streams, keys.dead], args) == n
    finally:
        await client.aclose()
    [(count, _results)] = reply_entries(rclient, keys.reply("pa"))
    assert count == n
    assert stream_lengths(rclient, keys) == [0] * keys.priorities


# -- malformed reply entries -------------------------------------------------------------------


async def test_malformed_replies_are_dropped_and_the_reader_carries_on(
    producer: AsyncProducer,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=PRODUCER_LOGGER)
    names = ["good1", "good2", "odd", "unhashable", "version", "status", "last"]
    handles = {name: await producer.submit(name, request_id=name) for name in names}
    pid = producer.producer_id
    reply_key = keys.reply(pid)
    bad_entries: list[dict[str, Any]] = [
        {"n": 1},  # no r
        {"n": 1, "r": b"\xc1"},  # not msgpack (a byte msgpack never uses)
        {"n": 1, "r": b"\x92\x01"},  # truncated msgpack
        {"n": 1, "r": b"not msgpack"},  # msgpack with extra data
        {"n": 1, "r": pickle.dumps(_Tripwire())},  # a pickle: never unpickled
        {"n": 1, "r": msgpack.packb({"id": "good1"})},  # a map, not an array
        {"n": 1, "r": msgpack.packb(5)},  # a number, not an array
    ]
    for fields in bad_entries:
        rclient.xadd(reply_key, fields)
    mixed = [
        flat(Result("good1", "ok", "G1")),
        42,  # not a list
        flat(Result("odd", "ok", "O"))[:-1],  # odd length
        [{"nested": "map"}, "x", *flat(Result("unhashable", "ok", "U"))],  # unhashable name
        flat(Result("version", "ok", "V"), v=str(SCHEMA_VERSION + 1)),  # another version
        flat(Result("status", "ok", "S"), status="maybe"),
        flat(Result("good2", "ok", "G2")),
    ]
    push_reply(rclient, keys, pid, mixed)
    push_reply(rclient, keys, pid, [flat(Result("last", "ok", "L"))])
    # Entries are read in order: once "last" is answered, every entry before it was handled.
    assert await producer.result(handles["last"], timeout_s=T) == "L"
    assert await producer.result(handles["good1"], timeout_s=0) == "G1"
    assert await producer.result(handles["good2"], timeout_s=0) == "G2"
    # One warning per malformed entry, however many malformed results it holds.
    dropped = [r for r in caplog.records if DROPPED in r.getMessage()]
    assert len(dropped) == len(bad_entries) + 1, [r.getMessage() for r in dropped]
    assert all(r.levelno == logging.WARNING for r in dropped)
    assert "(5 malformed results)" in dropped[-1].getMessage()
    assert not TRIPPED
    for name in ("odd", "unhashable", "version", "status"):  # still waiting for a real answer
        assert name in producer._waiting, name
        with pytest.raises(RequestTimeout):
            await producer.wait(handles[name], timeout_s=0)
    assert producer._reader is not None
    assert not producer._reader.done()
    # The reader keeps working: a worker answers the rest, and a later request, as usual.
    start_worker()
    for name in ("odd", "unhashable", "version", "status"):
        assert await producer.result(handles[name], timeout_s=T) == name
    assert await producer.infer("later", timeout_s=T) == "later"
    assert producer._waiting == {}
    await eventually(lambda: rclient.xlen(reply_key) == 0, "the reader to delete what it read")


async def test_a_poisoned_reply_between_two_batches_leaves_the_producer_answering(
    producer: AsyncProducer,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=PRODUCER_LOGGER)
    start_worker()
    assert await producer.map(["a", "b"], timeout_s=T) == ["a", "b"]
    # A reply whose numbers overflow every int: msgpack floats inf and nan, ints past uint64
    # (as text), a negative batch; plus one entry that is no msgpack at all.
    waiting = await producer.submit("x", request_id="poisoned")  # nobody answers it but this
    poison = [
        flat(Result("poisoned", "ok", "P"), batch=math.inf),
        flat(Result("poisoned", "ok", "P"), v=math.inf),
        flat(Result("poisoned", "ok", "P"), queue_ms=math.nan),
        flat(Result("poisoned", "ok", "P"), batch=str(2**70)),
        flat(Result("poisoned", "ok", "P"), batch="-3"),
    ]
    for result in poison:
        push_reply(rclient, keys, producer.producer_id, [result])
    rclient.xadd(keys.reply(producer.producer_id), {"n": 1, "r": b"\xc1\xff"})
    assert await producer.map(["c", "d", "e"], timeout_s=T) == ["c", "d", "e"]
    assert await producer.infer("f", timeout_s=T) == "f"
    assert producer._reader is not None
    assert not producer._reader.done()
    assert await producer.result(waiting, timeout_s=T) == "x"  # the worker's real answer
    dropped = [r for r in caplog.records if DROPPED in r.getMessage()]
    assert len(dropped) == len(poison) + 1, [r.getMessage() for r in dropped]
    await producer.aclose()  # clean: nothing re-raised
    assert producer._reader.done()
    assert producer._reader.exception() is None


async def test_get_result_on_a_malformed_key_raises_decode_error(
    producer: AsyncProducer, rclient: redis.Redis, keys: QueueKeys
) -> None:
    bad = {
        "inf-batch": packed_with(Result("inf-batch", "ok", 1), batch=math.inf),
        "huge-v": packed_with(Result("huge-v", "ok", 1), v=2**64 - 1),
        "nested-id": packed_with(Result("nested-id", "ok", 1), id=[["x"]]),
        "not-msgpack": b"\xc1",
        "a-map": msgpack.packb({"v": 2}),
    }
    for rid, data in bad.items():
        rclient.set(keys.result(rid), data)
        with pytest.raises(DecodeError, match=f"result key of request {rid} is malformed"):
            await producer.get_result(rid)
    rclient.set(keys.result("fine"), packed(Result("fine", "ok", "F")))
    found = await producer.get_result("fine")
    assert found is not None
    assert found.output == "F"


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


async def test_a_writer_connection_that_died_idle_is_replaced_before_the_write(
    redis_url: str, queue: str, rclient: redis.Redis
) -> None:
    # redis-py PINGs a connection idle past health_check_interval before its next command;
    # the producer runs that PING before sending, so a dead idle connection costs nothing
    # (neither a refused nor an uncertain write).
    url = f"{redis_url}?health_check_interval=1"
    async with AsyncProducer(redis_url=url, queue=queue) as producer:
        await producer.submit("a")
        writers = [int(c["id"]) for c in rclient.client_list() if c["cmd"] == "evalsha"]
        assert len(writers) == 1, writers
        rclient.client_kill_filter(_id=writers[0])
        await asyncio.sleep(1.2)  # past the interval: the next write is preceded by a PING
        await producer.submit("b")
        assert await producer.queue_depth() == 2


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
        assert sum(stream_lengths(rclient, keys)) == 2


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
    assert sum(stream_lengths(rclient, keys)) == 0
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
