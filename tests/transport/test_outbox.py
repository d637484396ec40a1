"""Outbox: one write in flight, the next takes everything that waited; and Backoff.retry.

Pure asyncio, no Redis: the writes are coroutines the tests hold open with events.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from batchline.transport import Backoff, Outbox


class Writes:
    """A write function that records its batches and holds each until released."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, batch: list[int]) -> None:
        self.batches.append(batch)
        self.started.set()
        await self.release.wait()
        self.release.clear()


async def test_what_waits_during_a_write_goes_in_the_next_one() -> None:
    writes = Writes()
    outbox: Outbox[int] = Outbox(writes)
    outbox.put(1)
    await writes.started.wait()  # the first write is in flight with [1]
    writes.started.clear()
    for n in (2, 3, 4):
        outbox.put(n)
    assert outbox.busy
    assert len(outbox) == 3
    writes.release.set()
    await writes.started.wait()  # the second write, with all that waited
    writes.release.set()
    await outbox.drain()
    assert writes.batches == [[1], [2, 3, 4]]
    assert not outbox.busy
    assert len(outbox) == 0


async def test_max_batch_splits_what_waited() -> None:
    seen: list[list[int]] = []

    async def write(batch: list[int]) -> None:
        seen.append(batch)

    outbox: Outbox[int] = Outbox(write, max_batch=2)
    for n in range(5):
        outbox.put(n)
    await outbox.drain()
    assert seen == [[0, 1], [2, 3], [4]]


async def test_a_cancelled_writer_hands_what_waits_to_abandon() -> None:
    writes = Writes()
    abandoned: list[int] = []
    outbox: Outbox[int] = Outbox(writes, abandon=abandoned.extend, name="test-writer")
    outbox.put(1)
    await writes.started.wait()
    outbox.put(2)
    outbox.put(3)
    task = next(t for t in asyncio.all_tasks() if t.get_name() == "test-writer")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert abandoned == [2, 3]
    assert not outbox.busy
    assert len(outbox) == 0


async def test_cancelling_a_drain_does_not_cancel_the_write() -> None:
    writes = Writes()
    outbox: Outbox[int] = Outbox(writes)
    outbox.put(1)
    await writes.started.wait()
    drain = asyncio.ensure_future(outbox.drain())
    await asyncio.sleep(0)
    drain.cancel()
    with pytest.raises(asyncio.CancelledError):
        await drain
    assert outbox.busy  # the write goes on
    writes.release.set()
    await outbox.drain()
    assert writes.batches == [[1]]


async def test_backoff_retry_rides_out_connection_errors_then_returns() -> None:
    calls = 0

    async def attempt() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise RedisConnectionError("gone")
        return "written"

    retry = Backoff(logging.getLogger("test"), "writer", max_delay_s=0.05)
    assert await retry.retry(attempt, budget_s=30.0) == "written"
    assert calls == 3
    assert retry.delay_s == 0.05  # reset after the call that worked


async def test_backoff_retry_raises_other_errors_at_once_and_past_its_budget() -> None:
    retry = Backoff(logging.getLogger("test"), "writer")
    calls = 0

    async def wrong_type() -> None:
        nonlocal calls
        calls += 1
        raise ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await retry.retry(wrong_type, budget_s=30.0)
    assert calls == 1

    async def down() -> None:
        raise RedisConnectionError("gone")

    with pytest.raises(RedisConnectionError):
        await retry.retry(down, budget_s=0.0)  # no budget: the first failure is raised
