"""How results come back to a producer: one reply entry per producer per completion (the
completion script's write), read by the producer's reply reader, which drops what is
malformed and carries on. (How ``infer`` writes and waits: test_infer.py.)

Where a test needs results to arrive in a given order, or malformed, it pushes reply
entries by hand onto the producer's reply stream (replies_by_hand.py), as the completion
script would (the protocol in docs/protocol.md), instead of racing a worker.
"""

from __future__ import annotations

import asyncio
import logging
import math
import pickle
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from batchline.codec import (
    SCHEMA_VERSION,
    DecodeError,
    Limits,
    Result,
    decode_result,
    encode_request,
    pack_value,
    unpack_result,
)
from batchline.errors import InferenceError, RequestTimeout
from batchline.keys import GROUP, QueueKeys
from batchline.producer import AsyncProducer
from batchline.transport import COMPLETE, Script, input_hash

from tests.support.replies_by_hand import eventually, flat, producer, push_reply
from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerThread,
    pending_count,
    stream_lengths,
    wait_until,
)

__all__ = ["producer"]  # the fixture, used here

T = RESULT_TIMEOUT_S
HUGE_MS = 600_000.0  # a batch timeout that never fires: batches flush by size
PRODUCER_LOGGER = "batchline.producer._replies"
DROPPED = "dropped a malformed reply"


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


class _Tripwire:
    """Pickles to a call of ``_trip``: if anything ever unpickled a reply, ``TRIPPED`` says so."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_trip, ())


TRIPPED: list[bool] = []


def _trip() -> None:
    TRIPPED.append(True)


# -- one reply entry per producer per completion ------------------------------------------------


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
async def test_malformed_replies_are_dropped_and_the_reader_carries_on(
    producer: AsyncProducer,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
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
    # One warning for the first malformed entry, then at most one per 10 s with the count
    # of those dropped meanwhile: a flood of forged entries does not flood the log.
    dropped = [r for r in caplog.records if DROPPED in r.getMessage()]
    assert len(dropped) == 1, [r.getMessage() for r in dropped]
    assert dropped[0].levelno == logging.WARNING
    monkeypatch.setattr(producer._replies, "_quiet_until", 0.0)
    push_reply(rclient, keys, pid, [42])
    await eventually(lambda: rclient.xlen(reply_key) == 0, "the reader to take it")
    dropped = [r.getMessage() for r in caplog.records if DROPPED in r.getMessage()]
    assert len(dropped) == 2, dropped
    assert f"(and {len(bad_entries)} more entries dropped before it)" in dropped[-1]
    assert not TRIPPED
    for name in ("odd", "unhashable", "version", "status"):  # still waiting for a real answer
        assert name in producer._waiting, name
        with pytest.raises(RequestTimeout):
            await producer.wait(handles[name], timeout_s=0)
    reading = producer._replies._task  # the reply reader's task: still running
    assert reading is not None
    assert not reading.done()
    # The reader keeps working: a worker answers the rest, and a later request, as usual.
    start_worker()
    for name in ("odd", "unhashable", "version", "status"):
        assert await producer.result(handles[name], timeout_s=T) == name
    assert await producer.infer("later", timeout_s=T) == "later"
    assert producer._waiting == {}
    await eventually(lambda: rclient.xlen(reply_key) == 0, "the reader to delete what it read")


async def test_an_error_without_its_input_hash_settles_no_request_sent_with_one(
    producer: AsyncProducer,
    rclient: redis.Redis,
    keys: QueueKeys,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An error without ``ih`` (what the admission answers an element someone else appended
    under a request's id and reply without ``meta``) is dropped and logged, and the
    request's own answer still settles it; an error with its ``ih`` is taken, and so is an
    answer without one that is not an error (a worker from before ``ih``)."""
    caplog.set_level(logging.WARNING, logger=PRODUCER_LOGGER)
    mine, failing, old = [await producer.submit(n, request_id=n) for n in ("mine", "bad", "old")]
    forged = Result("mine", "error", None, "MalformedRequest", "malformed request: forged")
    push_reply(rclient, keys, producer.producer_id, [flat(forged), flat(Result("old", "ok", "O"))])
    assert await producer.result(old, timeout_s=T) == "O"  # after the forged one
    assert "mine" in producer._waiting
    real_error = flat(Result("bad", "error", None, "ValueError", "no"), ih=hash_of("bad"))
    answer = flat(Result("mine", "ok", "M"), ih=hash_of("mine"))
    push_reply(rclient, keys, producer.producer_id, [real_error, answer])
    assert await producer.result(mine, timeout_s=T) == "M"
    with pytest.raises(InferenceError, match="ValueError: no"):
        await producer.result(failing, timeout_s=T)
    dropped = [r.getMessage() for r in caplog.records if DROPPED in r.getMessage()]
    assert len(dropped) == 1, dropped
    assert "an error for request mine without the input hash it was sent with" in dropped[0]


def hash_of(value: Any) -> str:
    """The input hash of a request of ``value`` (its ``ih``)."""
    return input_hash(*pack_value(value))


@pytest.mark.slow
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
    reading = producer._replies._task  # the reply reader's task: still running
    assert reading is not None
    assert not reading.done()
    assert await producer.result(waiting, timeout_s=T) == "x"  # the worker's real answer
    dropped = [r for r in caplog.records if DROPPED in r.getMessage()]
    assert len(dropped) == 1, [r.getMessage() for r in dropped]  # the rest counted, for later
    assert producer._replies._unreported == len(poison)
    await producer.aclose()  # clean: nothing re-raised
    assert reading.done()
    assert reading.cancelled() or reading.exception() is None


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


async def test_entries_whose_delete_failed_are_deleted_after_the_next_read(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reply entry read, whose XDEL failed (a network blip), is deleted with the next
    read's: left unread-looking, it would make the workers cancel this producer's streams
    (stream_max_unread_s)."""
    start_worker()
    original = AsyncRedis.xdel
    failed: list[tuple[Any, ...]] = []

    async def xdel(self: Any, name: Any, *ids: Any) -> Any:
        if not failed:
            failed.append(ids)
            raise redis.ConnectionError("a blip")
        return await original(self, name, *ids)

    monkeypatch.setattr(AsyncRedis, "xdel", xdel)
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        assert await producer.infer("one", timeout_s=T) == "one"
        assert failed
        reply = QueueKeys(queue).reply(producer.producer_id)
        await eventually(lambda: rclient.xlen(reply) == 0, "the entry read deleted after all")
        assert await producer.infer("two", timeout_s=T) == "two"
        await eventually(lambda: rclient.xlen(reply) == 0, "the next one deleted too")


async def test_requests_sent_while_the_reader_starts_over_leave_it_reading(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
) -> None:
    """A tenant's first request makes the reader start over with the tenant's reply stream
    added; requests sent meanwhile (an API's concurrent callers) must find it reading, not
    start a reader of their own that the start-over's stop ends at once: every answer then
    waited in the reply stream for the results' poll."""
    start_worker()
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        assert await producer.infer("warm", timeout_s=T) == "warm"
        values = [str(i) for i in range(8)]
        sent = [producer.infer(v, tenant="acme", timeout_s=T) for v in values]
        assert await asyncio.gather(*sent) == values
        own = QueueKeys(queue).reply(producer.producer_id)
        (reply,) = [key for key in producer._replies.keys if key != own]  # the tenant's
        # a reply entry pushed now is read (and deleted) by a live reader
        entry = rclient.xadd(reply, {"r": msgpack.packb([], use_bin_type=False)})
        await eventually(lambda: not rclient.xrange(reply, entry, entry), "the entry read")


async def test_an_idle_reader_under_a_short_socket_timeout_reports_no_failure(
    redis_url: str, queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A URL's ``socket_timeout`` (which bounds the commands: docs/service.md, EnqueueTimeout)
    must not cut the reader's blocking read, which answers only when its block ends: it
    blocks for less. Idle for four socket timeouts, it logs nothing."""
    url = f"{redis_url}?socket_timeout=0.5"
    with caplog.at_level(logging.WARNING):
        async with AsyncProducer(redis_url=url, queue=queue) as idle:
            await asyncio.sleep(2.0)  # four socket timeouts, nothing to read
            assert idle._replies.started
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def test_a_reader_replaced_while_redis_failed_still_recovers(
    redis_url: str, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replies written while the reader's reads failed may be gone (a failover): the first
    read that works again settles every waiting request from its result key. A reader
    started over meanwhile (``read_too``: a tenant's first request) must still do that, or
    those requests wait for their timeout."""
    original = AsyncRedis.xread
    cut: list[asyncio.Task[Any]] = []  # the task whose reads fail
    failures: list[float] = []

    async def xread(self: Any, *args: Any, **kwargs: Any) -> Any:
        if asyncio.current_task() in cut:
            failures.append(time.monotonic())
            raise redis.ConnectionError("Redis went away")
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(AsyncRedis, "xread", xread)
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        reader = producer._replies
        recoveries: list[float] = []

        async def recovered() -> None:
            recoveries.append(time.monotonic())

        reader._recovered = recovered
        reader.start("replies")
        first = reader._task
        assert first is not None
        cut.append(first)
        # its current block ends within a second; its next reads fail
        await eventually(lambda: bool(failures), "the first reader's reads failed")
        await reader.read_too(QueueKeys(queue).reply("acme.p1"))
        await eventually(lambda: bool(recoveries), "the new reader's first read recovers")
