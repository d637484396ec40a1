"""``batchline.dynamically``, the thread driver: failures of the batch function reach only
the callers they belong to (an exception, a wrong result length, a BaseException, a result
that cannot be read) and the batcher carries on; a full queue, and timed-out requests
dropped before their batch runs; end to end through the public API."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

import pytest

import batchline
from batchline import BatchFunctionError, QueueFull, RequestTimeout

from tests.support.driver_helpers import HUGE_MS, WAIT_S, Gate, concurrently, double

# -- errors ----------------------------------------------------------------------------------


def test_an_exception_reaches_only_the_bad_items_caller(closing: list[Any]) -> None:
    batches: list[list[int]] = []

    @batchline.dynamically(batch_size=4, timeout_ms=HUGE_MS)
    def f(xs: list[int]) -> list[int]:
        batches.append(list(xs))
        if 2 in xs:
            raise ValueError("cannot take 2")
        return double(xs)

    closing.append(f)
    futures = concurrently(f, [0, 1, 2, 3])
    assert sorted(batches[0]) == [0, 1, 2, 3], "all four callers shared the first batch"
    assert [futures[i].result() for i in (0, 1, 3)] == [0, 2, 6]
    with pytest.raises(ValueError, match="cannot take 2"):
        futures[2].result()
    assert f.stats.errors == 1
    assert f([7, 8, 9, 10]) == [14, 16, 18, 20], "the batcher carries on"


def test_isolate_errors_false_fails_the_whole_batch(closing: list[Any]) -> None:
    calls: list[list[int]] = []

    @batchline.dynamically(batch_size=2, timeout_ms=HUGE_MS, isolate_errors=False)
    def f(xs: list[int]) -> list[int]:
        calls.append(xs)
        raise ValueError("all fail")

    closing.append(f)
    for fut in concurrently(f, [0, 1]):
        with pytest.raises(ValueError, match="all fail"):
            fut.result()
    assert len(calls) == 1


def test_wrong_result_length_fails_every_caller(closing: list[Any]) -> None:
    @batchline.dynamically(batch_size=3, timeout_ms=HUGE_MS)
    def f(xs: list[int]) -> list[int]:
        return xs[:-1]

    closing.append(f)
    for fut in concurrently(f, [0, 1, 2]):
        with pytest.raises(BatchFunctionError, match="2 results for 3 inputs"):
            fut.result()
    assert f.stats.errors == 3


@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt])
def test_a_base_exception_does_not_kill_the_batcher(
    exc_type: type[BaseException], closing: list[Any]
) -> None:
    calls = 0

    @batchline.dynamically(timeout_ms=0)
    def f(xs: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise exc_type("stop")
        return double(xs)

    closing.append(f)
    with pytest.raises(BatchFunctionError) as info:
        f(1)
    assert isinstance(info.value.__cause__, exc_type)
    assert f(2) == 4
    assert f([3, 4]) == [6, 8]


def test_queue_full_is_raised_at_once(gate: Gate, closing: list[Any]) -> None:
    @batchline.dynamically(batch_size=1, timeout_ms=0, max_queue_size=2)
    def f(xs: list[int]) -> list[int]:
        if xs == [0]:
            gate.hold()
        return double(xs)

    closing.append(f)

    async def scenario() -> None:
        first = asyncio.ensure_future(f.acall(0))
        await asyncio.to_thread(gate.wait_entered)  # item 0 left the queue, into f
        queued = asyncio.ensure_future(f.acall([1, 2]))
        await asyncio.sleep(0)  # its first step queues both items
        assert f.stats.queue_size == 2
        with pytest.raises(QueueFull, match="max_queue_size=2"):
            await f.acall(3)
        with pytest.raises(QueueFull):
            await asyncio.to_thread(f, 3)
        with pytest.raises(QueueFull):
            await asyncio.to_thread(f, [3, 4, 5])
        gate.release.set()
        assert await first == 0
        assert await queued == [2, 4]

    asyncio.run(scenario())
    assert f.stats.rejected == 5
    assert f(6) == 12, "room again once the queue drained"


def test_timeout_s_drops_the_item_before_its_batch_runs(gate: Gate, closing: list[Any]) -> None:
    seen: list[list[int]] = []

    @batchline.dynamically(batch_size=1, timeout_ms=0)
    def f(xs: list[int]) -> list[int]:
        seen.append(list(xs))
        if xs == [0]:
            gate.hold()
        return double(xs)

    closing.append(f)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    first = pool.submit(f, 0)
    gate.wait_entered()  # the worker is busy: item 1 can only wait in the queue
    with pytest.raises(RequestTimeout):
        f(1, timeout_s=0.05)
    with pytest.raises(RequestTimeout):
        f([2, 3], deadline=time.monotonic())
    gate.release.set()
    assert first.result(WAIT_S) == 0
    pool.shutdown()
    assert f(4) == 8
    assert seen == [[0], [4]], "timed-out items never reach the function"
    assert f.stats.errors == 3


async def test_acall_timeout_s_drops_the_item(gate: Gate, closing: list[Any]) -> None:
    seen: list[list[int]] = []

    @batchline.dynamically(batch_size=1, timeout_ms=0)
    def f(xs: list[int]) -> list[int]:
        seen.append(list(xs))
        if xs == [0]:
            gate.hold()
        return double(xs)

    closing.append(f)
    first = asyncio.ensure_future(f.acall(0))
    await asyncio.to_thread(gate.wait_entered)
    with pytest.raises(RequestTimeout):
        await f.acall(1, timeout_s=0.05)
    gate.release.set()
    assert await first == 0
    assert await f.acall(2) == 4
    assert seen == [[0], [2]]


def test_bad_timeout_s_is_refused(closing: list[Any]) -> None:
    f = batchline.dynamically(double)
    closing.append(f)
    with pytest.raises(ValueError, match="timeout_s must be >= 0"):
        f(1, timeout_s=-1)


class _BrokenSequence:
    """Sized like a good result, but iterating it raises."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        raise RuntimeError("cannot iterate")


def test_a_result_that_cannot_be_read_fails_its_callers_and_the_batcher_lives_on():
    calls = []

    @batchline.dynamically(batch_size=4, timeout_ms=0)
    def broken_then_fine(items):
        calls.append(list(items))
        return _BrokenSequence(len(items)) if len(calls) == 1 else items

    with pytest.raises(BatchFunctionError):
        broken_then_fine(1, timeout_s=30)
    assert broken_then_fine(2, timeout_s=30) == 2
    broken_then_fine.close()
