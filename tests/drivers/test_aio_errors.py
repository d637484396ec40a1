"""``batchline.aio.dynamically``, the asyncio driver: cancelled and timed-out callers
dropped before their batch runs, failures of the batch function reaching only the callers
they belong to (an exception, a wrong result length, a BaseException, a CancelledError or
StopIteration it raises, a result that cannot be read), and a full queue; end to end
through the public API."""

from __future__ import annotations

import asyncio

import pytest

import batchline
from batchline import BatchFunctionError, QueueFull, RequestTimeout

from tests.support.driver_helpers import HUGE_MS, AsyncGate, adouble, double

# -- cancellation and timeouts ---------------------------------------------------------------


async def test_a_cancelled_callers_item_is_dropped_before_its_batch() -> None:
    gate = AsyncGate()
    seen: list[list[int]] = []

    @batchline.aio.dynamically(batch_size=1, timeout_ms=0)
    async def f(xs: list[int]) -> list[int]:
        seen.append(list(xs))
        if xs == [0]:
            await gate.hold()
        return double(xs)

    first = asyncio.create_task(f(0))
    await gate.entered.wait()
    doomed = asyncio.create_task(f(1))
    await asyncio.sleep(0)  # its item is queued behind the running batch
    assert f.stats.queue_size == 1
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    gate.release.set()
    assert await first == 0
    assert await f(2) == 4
    assert seen == [[0], [2]]
    await f.aclose()


async def test_timeout_s_drops_the_item() -> None:
    gate = AsyncGate()
    seen: list[list[int]] = []

    @batchline.aio.dynamically(batch_size=1, timeout_ms=0)
    async def f(xs: list[int]) -> list[int]:
        seen.append(list(xs))
        if xs == [0]:
            await gate.hold()
        return double(xs)

    first = asyncio.create_task(f(0))
    await gate.entered.wait()
    with pytest.raises(RequestTimeout):
        await f(1, timeout_s=0.05)
    with pytest.raises(TimeoutError):  # RequestTimeout is a TimeoutError
        await f([2, 3], timeout_s=0)
    gate.release.set()
    assert await first == 0
    assert await f(4) == 8
    assert seen == [[0], [4]]
    assert f.stats.errors == 3
    await f.aclose()


async def test_a_deadline_passing_in_an_idle_queue_raises_and_nothing_runs() -> None:
    # The worker sleeps until the earliest deadline (not the huge timeout): either it or the
    # caller notices the deadline first; both end in RequestTimeout with nothing run.
    f = batchline.aio.dynamically(batch_size=8, timeout_ms=HUGE_MS)(adouble)
    with pytest.raises(RequestTimeout):
        await f(1, timeout_s=0.02)
    assert f.stats.items == 0
    assert f.stats.queue_size == 0
    await f.aclose()


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("is_async", [True, False])
async def test_an_exception_reaches_only_the_bad_items_caller(is_async: bool) -> None:
    calls: list[list[int]] = []

    def body(xs: list[int]) -> list[int]:
        calls.append(list(xs))
        if 2 in xs:
            raise ValueError("cannot take 2")
        return double(xs)

    async def abody(xs: list[int]) -> list[int]:
        return body(xs)

    f = batchline.aio.dynamically(batch_size=4, timeout_ms=HUGE_MS)(abody if is_async else body)
    outcomes = await asyncio.gather(*(f(i) for i in range(4)), return_exceptions=True)
    assert outcomes[:2] == [0, 2]
    assert isinstance(outcomes[2], ValueError)
    assert outcomes[3] == 6
    assert calls[0] == [0, 1, 2, 3]
    assert f.stats.errors == 1
    await f.aclose()


async def test_wrong_result_length_fails_every_caller() -> None:
    @batchline.aio.dynamically(batch_size=2, timeout_ms=HUGE_MS)
    async def f(xs: list[int]) -> list[int]:
        return []

    outcomes = await asyncio.gather(f(1), f(2), return_exceptions=True)
    assert all(isinstance(o, BatchFunctionError) for o in outcomes)
    await f.aclose()


@pytest.mark.parametrize("is_async", [True, False])
async def test_a_base_exception_does_not_kill_the_batcher(is_async: bool) -> None:
    calls = 0

    def body(xs: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise SystemExit(3)
        return double(xs)

    async def abody(xs: list[int]) -> list[int]:
        return body(xs)

    f = batchline.aio.dynamically(timeout_ms=0)(abody if is_async else body)
    with pytest.raises(BatchFunctionError) as info:
        await f(1)
    assert isinstance(info.value.__cause__, SystemExit)
    assert await f(2) == 4
    await f.aclose()


async def test_a_cancelled_error_raised_by_the_function_is_isolated() -> None:
    @batchline.aio.dynamically(timeout_ms=0)
    async def f(xs: list[int]) -> list[int]:
        if xs == [1]:
            raise asyncio.CancelledError
        return double(xs)

    with pytest.raises(BatchFunctionError):
        await f(1)
    assert await f(2) == 4
    await f.aclose()


async def test_queue_full_is_raised_at_once() -> None:
    gate = AsyncGate()

    @batchline.aio.dynamically(batch_size=1, timeout_ms=0, max_queue_size=2)
    async def f(xs: list[int]) -> list[int]:
        if xs == [0]:
            await gate.hold()
        return double(xs)

    first = asyncio.create_task(f(0))
    await gate.entered.wait()
    queued = asyncio.create_task(f([1, 2]))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await f(3)
    gate.release.set()
    assert await first == 0
    assert await queued == [2, 4]
    assert f.stats.rejected == 1
    await f.aclose()


async def test_stop_iteration_from_a_plain_function_reaches_the_caller():
    @batchline.aio.dynamically(batch_size=4, timeout_ms=0, isolate_errors=False)
    def broken(items):
        raise StopIteration("done")

    with pytest.raises(RuntimeError, match="StopIteration"):
        await broken(1)


async def test_a_result_that_cannot_be_read_fails_its_callers_and_the_aio_batcher_lives_on():
    class Broken:
        def __len__(self):
            return 1

        def __iter__(self):
            raise RuntimeError("cannot iterate")

    seen = []

    @batchline.aio.dynamically(batch_size=4, timeout_ms=0)
    async def broken_then_fine(items):
        seen.append(items)
        return Broken() if len(seen) == 1 else items

    with pytest.raises(BatchFunctionError):
        await broken_then_fine(1, timeout_s=30)
    assert await broken_then_fine(2, timeout_s=30) == 2
