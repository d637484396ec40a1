"""What producer rights can write through the inbox and the queue's functions, tried as an
attacker would, with users made from docs/protocol.md's own ``batchline acl`` lines: an
element refused by the admission under another request's id and reply does not fail that
request; job keys and the counters are written by the admission alone (bounded, expiring,
for what it decides); and the admission holds the queue's depth bound whoever wrote the
inbox. Real Redis 7; the admission is run as a worker would run it (``admit_inbox``), or by
a worker in this process."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import redis

from batchline.codec import Limits, decode_result, pack_value, unpack_result
from batchline.errors import QueueFull, RequestIdConflict
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer
from batchline.transport import JOB, input_hash, job_note

from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerThread,
    admit_inbox,
    stream_lengths,
)

T = RESULT_TIMEOUT_S
TTL_S = 120


def hash_of(value: Any) -> str:
    return input_hash(*pack_value(value))


def raw(*element: Any) -> bytes:
    """An inbox element written by hand, as a forger would ``RPUSH`` it."""
    return msgpack.packb(list(element), use_bin_type=False)


def once_figures(client: redis.Redis, keys: QueueKeys) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(keys.once_stats).items()}


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.slow
async def test_a_forged_error_does_not_fail_a_waiting_request(
    urls: dict[str, str],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    queue: str,
    caplog: pytest.LogCaptureFixture,
    when: str,
) -> None:
    """An element with a priority out of range (and no ``meta``), appended under a waiting
    request's id and reply, is refused by the admission: ``before`` that request's own
    admission, its error (no ``ih``) is pushed and the victim's producer drops it; ``after``,
    the id belongs to a request, so no error is pushed at all (the dead letter says
    ``withheld``). Either way the victim gets its own answer (before: the forged error)."""
    caplog.set_level(logging.WARNING)
    common = {"queue": queue, "result_ttl_s": TTL_S}
    thief = redis.Redis.from_url(urls["producer"])
    try:
        async with AsyncProducer(redis_url=urls["producer"], **common) as victim:
            forged = raw("r", 99, "v", "2", "id", "order-7", "reply", victim.producer_id)
            if when == "before":
                thief.rpush(keys.inbox, forged)
                mine = await victim.submit("the victim's input", request_id="order-7")
            else:
                mine = await victim.submit("the victim's input", request_id="order-7")
                admit_inbox(rclient, keys, result_ttl_s=TTL_S)
                thief.rpush(keys.inbox, forged)
            start_worker(redis_url=urls["worker"], **common)
            result = await victim.wait(mine, timeout_s=T)
    finally:
        thief.close()
    assert (result.status, result.output) == ("ok", "the victim's input")
    [(_entry, dead)] = rclient.xrange(keys.dead)
    assert dead[b"reason"].startswith(b"MalformedRequest: inbox element refused: its priority")
    assert (dead[b"id"], dead[b"reply"]) == (b"order-7", victim.producer_id.encode())
    messages = [r.getMessage() for r in caplog.records]
    if when == "before":
        assert b"withheld" not in dead
        assert any("order-7 without the input hash it was sent with" in m for m in messages)
    else:
        assert dead[b"withheld"] == b"1"
        assert any("1 errors withheld" in m for m in messages), messages


async def test_job_keys_are_the_admissions_to_write(
    urls: dict[str, str], rclient: redis.Redis, keys: QueueKeys, queue: str
) -> None:
    """Producer rights may not ``SET`` or ``DEL`` a job key (any size, no expiry, before);
    a job note on the job list becomes one at most a name long, ``NX``, expiring with the
    results; anything else there is dead-lettered."""
    thief = redis.Redis.from_url(urls["producer"])
    try:
        for attempt in (
            lambda: thief.set(keys.job("forged"), b"x" * (1 << 20)),
            lambda: thief.set(keys.job("forged"), "embedding", ex=60),
            lambda: thief.delete(keys.job("order-1")),
            lambda: thief.expire(keys.job("order-1"), 1),
            lambda: thief.lpop(keys.job_list),
            lambda: thief.lrange(keys.job_list, 0, -1),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        async with AsyncProducer(redis_url=urls["producer"], queue=queue) as producer:
            await producer.submit("polled", request_id="order-1", reply=False)
        assert thief.fcall(JOB, 1, keys.job_list, "order-1", "embedding", "x", "y" * 129) == 1
        assert thief.lpos(keys.job_list, job_note("order-1", "embedding")) == 0
        thief.rpush(keys.job_list, raw("j", "order-2", "z" * 100_000))
        assert thief.fcall(JOB, 1, keys.job_list, "order-1", "embeddings") == 1  # NX: the first
        thief.rpush(keys.inbox, raw("j", "order-3", "embedding"))  # no job note there
        admit_inbox(rclient, keys, result_ttl_s=TTL_S)
    finally:
        thief.close()
    assert rclient.get(keys.job("order-1")) == b"embedding"
    assert 0 < rclient.ttl(keys.job("order-1")) <= TTL_S
    assert rclient.keys(keys.job("*")) == [keys.job("order-1").encode()]
    assert rclient.llen(keys.job_list) == 0
    reasons = sorted(fields[b"reason"] for _entry, fields in rclient.xrange(keys.dead))
    assert reasons == [
        b"MalformedRequest: inbox element refused: in the job list: not a job note",
        b"MalformedRequest: inbox element refused: not a request, a cancel or a note",
    ]


async def test_the_counters_count_only_what_the_admission_decides(
    urls: dict[str, str], rclient: redis.Redis, keys: QueueKeys, queue: str
) -> None:
    """Producer rights may not ``HINCRBY`` the counters (a billion hits, before); the
    enqueue function's answers at once reach them as notes, each counted as the admission
    decides it again: a note for an unknown id, or a hit no cache holds, counts nothing
    (a note the forger appends by hand counts what a call of the function would)."""
    thief = redis.Redis.from_url(urls["producer"])
    try:
        for attempt in (
            lambda: thief.hincrby(keys.once_stats, "hit", 10**9),
            lambda: thief.hset(keys.once_stats, "miss", 0),
            lambda: thief.expire(keys.once_stats, 1),
            lambda: thief.delete(keys.once_stats),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        async with AsyncProducer(redis_url=urls["producer"], queue=queue) as producer:
            await producer.submit("a", request_id="order-5", reply=False)
            admit_inbox(rclient, keys, result_ttl_s=TTL_S)
            with pytest.raises(RequestIdConflict):
                await producer.submit("b", request_id="order-5", reply=False)
        assert once_figures(rclient, keys) == {}  # nothing counted by producer rights
        thief.rpush(
            keys.inbox,
            raw("h", "order-5", hash_of("b"), ""),  # as the function's conflict note
            raw("h", "unknown", hash_of("b"), ""),
            raw("h", "order-5", hash_of("a"), ""),  # the same input, no result: nothing
            raw("h", "order-5", hash_of("a"), "0" * 40),  # a hit of no cache entry
        )
        admit_inbox(rclient, keys, result_ttl_s=TTL_S)
    finally:
        thief.close()
    assert once_figures(rclient, keys) == {"conflict": 2}
    assert rclient.xlen(keys.dead) == 0


async def test_the_admission_holds_the_queue_depth_whoever_writes_the_inbox(
    urls: dict[str, str], rclient: redis.Redis, keys: QueueKeys, queue: str
) -> None:
    """3,000 requests appended to the inbox by hand (before: every one admitted, the depth
    being a bound the caller passes) against a worker's ``max_queue_depth`` of 100: 100
    are admitted, the rest answered ``QueueFull``, as a request cut short (a resubmit runs
    again once there is room)."""
    bound, flood = 100, 3000
    thief = redis.Redis.from_url(urls["producer"])
    try:
        elements = [
            raw("r", 1, "v", "2", "id", f"flood-{i}", "meta", '"x"', "reply", "thief")
            for i in range(flood)
        ]
        thief.rpush(keys.inbox, *elements)
    finally:
        thief.close()
    admit_inbox(rclient, keys, max_queue_depth=bound, result_ttl_s=TTL_S)
    assert sum(stream_lengths(rclient, keys)) == bound
    refused = unpack_result(rclient.get(keys.result(f"flood-{flood - 1}")), Limits())
    assert (refused.status, refused.error_type) == ("error", "QueueFull")
    assert refused.input_hash == hash_of("x")
    assert rclient.get(keys.request_input(f"flood-{flood - 1}")).endswith(b" !")
    pushed = [
        decode_result(dict(zip(f[::2], f[1::2], strict=True)), Limits())
        for _entry, fields in rclient.xrange(keys.reply("thief"))
        for f in msgpack.unpackb(fields[b"r"], raw=True)
    ]
    assert len(pushed) == flood - bound
    assert {r.error_type for r in pushed} == {"QueueFull"}
    # A producer whose own bound is off is answered QueueFull by the admission; once there
    # is room, a resubmit of the id runs.
    common = {"queue": queue, "max_queue_depth": 0, "result_ttl_s": TTL_S}
    async with AsyncProducer(redis_url=urls["producer"], **common) as producer:
        handle = await producer.submit("one more", request_id="one-more")
        admit_inbox(rclient, keys, max_queue_depth=bound, result_ttl_s=TTL_S)
        with pytest.raises(QueueFull, match="max_queue_depth=100"):
            await producer.result(handle, timeout_s=T)
        rclient.delete(*keys.streams)  # room again
        await producer.submit("one more", request_id="one-more")
        admit_inbox(rclient, keys, max_queue_depth=bound, result_ttl_s=TTL_S)
    ((_entry, fields),) = rclient.xrange(keys.stream(1))
    assert fields[b"id"] == b"one-more"
