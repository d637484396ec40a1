"""The byte cap of one read: ReadCap's COUNT after large entries (on its own), and a worker
that dead-letters an entry larger than any valid request without decoding it (real Redis,
a worker in this process; a spy on the decoder counts what the reader decoded)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis

import batchline.worker.serving._intake as intake_module
from batchline.codec import SCHEMA_VERSION, encode_request
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer
from batchline.worker.serving._reader import ReadCap, entry_bytes
from batchline.worker.shared._held import Entry

from tests.support.models_for_tests import HeavyEcho
from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerThread,
    pending_count,
    poll_result,
    wait_until,
)


def _entries(*sizes: int) -> list[Entry]:
    """Entries of one field each, of these total sizes (field name b"x")."""
    return [(0, f"{i}-0".encode(), {b"x": b"a" * (n - 1)}) for i, n in enumerate(sizes)]


def test_count_is_the_room_split_over_the_streams_until_an_entry_is_seen() -> None:
    cap = ReadCap(max_read_bytes=1000, max_entry_bytes=500)
    assert [cap.count(room, 3) for room in (90, 91, 1, 0)] == [30, 31, 1, 1]


def test_count_drops_after_large_entries_and_recovers_after_small_ones() -> None:
    cap = ReadCap(max_read_bytes=12_000, max_entry_bytes=5000)
    kept, too_large = cap.split(_entries(10, 4000, 10))
    assert (len(kept), too_large, cap.largest_bytes) == (3, [], 4000)
    assert cap.count(300, 3) == 1  # 3 streams x 1 entry x 4000 bytes <= 12000
    counts = []
    for _ in range(10):
        cap.split(_entries(10, 10))
        counts.append(cap.count(300, 3))
    assert counts == [2, 4, 8, 16, 32, 64, 100, 100, 100, 100]  # then the room decides
    assert cap.largest_bytes == 10  # 4000 halved per read, down to the small entries


def test_entries_larger_than_any_request_are_split_out_with_their_size() -> None:
    cap = ReadCap(max_read_bytes=1 << 20, max_entry_bytes=100)
    batch = _entries(100, 101, 5, 1000)
    batch.append((1, b"9-0", None))  # deleted while pending: size 0, kept
    kept, too_large = cap.split(batch)
    assert [e for _s, e, _r in kept] == [b"0-0", b"2-0", b"9-0"]
    assert [(e, size) for (_s, e, _r), size in too_large] == [(b"1-0", 101), (b"3-0", 1000)]
    assert (cap.refused, cap.largest_bytes) == (2, 1000)
    assert entry_bytes(None) == 0


@pytest.mark.slow
async def test_an_oversized_entry_is_dead_lettered_unread(
    redis_url: str,
    keys: QueueKeys,
    rclient: redis.Redis,
    start_worker: Callable[..., WorkerThread],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decoded_sizes: list[int] = []
    real_decode = intake_module.decode_requests

    def spy(raws: list[Any]) -> Any:
        decoded_sizes.extend(entry_bytes(raw) for raw in raws)
        return real_decode(raws)

    monkeypatch.setattr(intake_module, "decode_requests", spy)
    async with AsyncProducer(redis_url=redis_url, queue=keys.queue) as producer:
        before = await producer.submit("before")
        # 3 MiB of value data: more than max_elements=1000 allows (8,000 bytes of data plus
        # a 1 MiB header plus 64 KiB: the largest valid request), written around the producer.
        fields = encode_request(
            "big-1",
            "x",
            enqueued_unix_ms=0.0,
            reply=producer.producer_id,
        )
        fields["blob"] = b"\0" * (3 << 20)
        assert fields["v"] == str(SCHEMA_VERSION)
        rclient.xadd(keys.stream(0), fields)  # type: ignore[arg-type]
        after = await producer.submit("after")
        thread = start_worker(max_elements=1000, max_read_bytes=1 << 20)
        assert await producer.result(before, timeout_s=RESULT_TIMEOUT_S) == "before"
        assert await producer.result(after, timeout_s=RESULT_TIMEOUT_S) == "after"
        found = await poll_result(producer, "big-1")
        assert (found.status, found.error_type) == ("error", "MalformedRequest"), found
        assert "exceeds the largest request" in found.error_message
        wait_until(lambda: rclient.xlen(keys.dead) == 1, "the dead letter")
        dead: Any = rclient.xrange(keys.dead)
        assert dead[0][1][b"reason"].startswith(b"MalformedRequest: entry of ")
        raw = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}
        assert dead[0][1][b"size"] == str(entry_bytes(raw)).encode()
        assert b"blob" not in dead[0][1]  # not copied into the dead letter
        assert dead[0][1][b"id"] == b"big-1"  # the fields that fit are kept, the id first
        wait_until(lambda: pending_count(rclient, keys) == 0, "nothing pending")
        cap = thread.worker._parts.readcap
        assert cap.refused == 1
        assert cap.count(1000, keys.priorities) == 1  # right after it: one entry a stream
    assert decoded_sizes
    assert max(decoded_sizes) < 1 << 20  # the large entry was never decoded


@pytest.mark.slow
async def test_a_read_of_only_an_oversized_entry_on_preparing_threads(
    redis_url: str,
    keys: QueueKeys,
    rclient: redis.Redis,
    start_worker: Callable[..., WorkerThread],
) -> None:
    # The only entry is too large: the read leaves nothing to prepare on the threads of a
    # model with heavy preprocessing, and the worker carries on.
    async with AsyncProducer(redis_url=redis_url, queue=keys.queue) as producer:
        fields = encode_request("big-2", "x", enqueued_unix_ms=0.0, reply=producer.producer_id)
        fields["blob"] = b"\0" * (3 << 20)
        rclient.xadd(keys.stream(0), fields)  # type: ignore[arg-type]
        thread = start_worker(
            HeavyEcho(), max_elements=1000, max_read_bytes=1 << 20, prep_threads=2
        )
        found = await poll_result(producer, "big-2")
        assert (found.status, found.error_type) == ("error", "MalformedRequest"), found
        assert await producer.infer("after", timeout_s=RESULT_TIMEOUT_S) == "after"
        assert thread.alive
        assert thread.worker.stats()["prepare"]["threads"] == 2
