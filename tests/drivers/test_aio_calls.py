"""``batchline.aio.dynamically``, the asyncio driver: decorating and calling (a coroutine
function on the loop, a plain one off it), use across event loops (none kept alive), the
lifecycle (``aclose``, ``close``, ``with``, ``async with``), statistics and methods; end to
end through the public API."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from typing import Any

import pytest

import batchline
from batchline import AioBatcher, BatcherClosed

from tests.support.driver_helpers import HUGE_MS, WAIT_S, adouble, double

# -- decorating and calling ------------------------------------------------------------------


async def test_coroutine_function_runs_on_the_loop() -> None:
    threads: list[threading.Thread] = []

    @batchline.aio.dynamically
    async def f(xs: list[int]) -> list[int]:
        threads.append(threading.current_thread())
        return await adouble(xs)

    assert isinstance(f, AioBatcher)
    assert f.__name__ == "f"
    assert await f(3) == 6
    assert await f([1, 2]) == [2, 4]
    assert await f([]) == []
    assert threads[0] is threading.current_thread()
    await f.aclose()


async def test_plain_function_runs_off_the_loop() -> None:
    threads: list[threading.Thread] = []

    @batchline.aio.dynamically(batch_size=4, timeout_ms=0)
    def f(xs: list[int]) -> list[int]:
        threads.append(threading.current_thread())
        return double(xs)

    assert await f(3) == 6
    assert await f([1, 2, 3, 4, 5]) == [2, 4, 6, 8, 10]
    assert threads[0] is not threading.current_thread(), "the loop stays free"
    await f.aclose()


@pytest.mark.parametrize("fn", [adouble, double])
async def test_a_thousand_tasks(fn: Any) -> None:
    sizes: list[int] = []

    async def recorded(xs: list[int]) -> list[int]:
        sizes.append(len(xs))
        return await adouble(xs)

    def recorded_sync(xs: list[int]) -> list[int]:
        sizes.append(len(xs))
        return double(xs)

    f = batchline.aio.dynamically(batch_size=32)(recorded if fn is adouble else recorded_sync)
    results = await asyncio.gather(*(f(i) for i in range(1000)))
    assert results == [i * 2 for i in range(1000)]
    assert max(sizes) <= 32
    assert sum(sizes) == 1000
    assert f.stats.mean_batch_size > 1
    assert f.stats.items == 1000
    await f.aclose()


# -- across event loops ----------------------------------------------------------------------


@batchline.aio.dynamically(batch_size=8, timeout_ms=1)
async def module_level(xs: list[int]) -> list[int]:
    return await adouble(xs)


@batchline.aio.dynamically(batch_size=8, timeout_ms=1)
def module_level_sync(xs: list[int]) -> list[int]:
    return double(xs)


@pytest.mark.parametrize("batcher", [module_level, module_level_sync])
def test_works_across_two_asyncio_runs(batcher: Any) -> None:
    async def use(offset: int) -> list[int]:
        return list(await asyncio.gather(*(batcher(offset + i) for i in range(20))))

    assert asyncio.run(use(0)) == [i * 2 for i in range(20)]
    assert asyncio.run(use(100)) == [(100 + i) * 2 for i in range(20)]


def test_a_loop_that_ends_with_a_call_pending_does_not_break_the_next_loop() -> None:
    f = batchline.aio.dynamically(batch_size=8, timeout_ms=HUGE_MS)(adouble)
    leftovers: list[asyncio.Task[Any]] = []

    async def leave_one_behind() -> None:
        leftovers.append(asyncio.create_task(f(1)))
        await asyncio.sleep(0)  # queued, never flushed: asyncio.run cancels it at the end

    asyncio.run(leave_one_behind())
    assert leftovers[0].cancelled()

    async def fill_a_batch() -> list[int]:
        return list(await asyncio.gather(*(f(i) for i in range(8))))

    assert asyncio.run(fill_a_batch()) == [i * 2 for i in range(8)]
    assert f.stats.items == 8, "the abandoned item never ran"


def test_event_loops_are_not_kept_alive_by_the_batcher():
    import gc
    import weakref

    @batchline.aio.dynamically(batch_size=4, timeout_ms=0)
    def echo(items):
        return items

    loops = []

    async def use():
        loops.append(weakref.ref(asyncio.get_running_loop()))
        return await echo([1, 2, 3])

    assert asyncio.run(use()) == [1, 2, 3]
    assert asyncio.run(use()) == [1, 2, 3]
    gc.collect()
    assert loops[0]() is None, "the first event loop is still referenced after asyncio.run"
    assert len(echo._states) <= 1


# -- lifecycle -------------------------------------------------------------------------------


async def _queue_three(f: Any) -> list[asyncio.Task[Any]]:
    tasks = [asyncio.create_task(f(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert f.stats.queue_size == 3
    return tasks


async def test_aclose_with_drain_runs_what_is_queued() -> None:
    f = batchline.aio.dynamically(batch_size=8, timeout_ms=HUGE_MS)(adouble)
    tasks = await _queue_three(f)
    async with asyncio.timeout(30):
        await f.aclose()
    assert all(t.done() for t in tasks), "aclose() waits for the drained batch"
    assert [t.result() for t in tasks] == [0, 2, 4]
    with pytest.raises(BatcherClosed):
        await f(1)
    assert f.stats.rejected == 1


@pytest.mark.parametrize("how", ["aclose", "close", "close_from_a_thread"])
async def test_closing_without_drain_rejects_what_is_queued(how: str) -> None:
    seen: list[int] = []

    @batchline.aio.dynamically(batch_size=8, timeout_ms=HUGE_MS)
    def f(xs: list[int]) -> list[int]:
        seen.extend(xs)
        return xs

    tasks = await _queue_three(f)
    if how == "aclose":
        await f.aclose(drain=False)
    elif how == "close":
        f.close(drain=False)
    else:
        await asyncio.to_thread(f.close, drain=False)
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(o, BatcherClosed) for o in outcomes)
    assert seen == []
    assert f.closed


@pytest.mark.parametrize("is_async", [True, False])
@pytest.mark.parametrize("how", ["close", "close_from_a_thread", "with"])
async def test_close_drains_what_is_queued_without_waiting(how: str, is_async: bool) -> None:
    ran_on: list[threading.Thread] = []

    def drained(xs: list[int]) -> list[int]:
        ran_on.append(threading.current_thread())
        return double(xs)

    async def adrained(xs: list[int]) -> list[int]:
        return drained(xs)

    f = batchline.aio.dynamically(batch_size=8, timeout_ms=HUGE_MS)(
        adrained if is_async else drained
    )
    tasks = await _queue_three(f)
    if how == "close":
        f.close()
    elif how == "close_from_a_thread":
        await asyncio.to_thread(f.close)
    else:
        with f:  # a sync ``with`` closes as close() does
            pass
    assert f.closed
    with pytest.raises(BatcherClosed):
        await f(1)
    async with asyncio.timeout(WAIT_S):  # the loop's worker runs them as the loop goes on
        assert await asyncio.gather(*tasks) == [0, 2, 4]
    (thread,) = set(ran_on)
    if is_async:
        assert thread is threading.current_thread()
    else:  # a plain function ran on a thread of the batcher's: it ends with the drain
        assert thread is not threading.current_thread()
        thread.join(WAIT_S)
        assert not thread.is_alive()


def test_close_after_the_loop_ended_ends_the_batchers_thread() -> None:
    """A plain function's batcher used under ``asyncio.run`` and closed after: no loop is
    left to drain anything, and close() ends the batcher's thread itself."""
    ran_on: list[threading.Thread] = []

    def recorded(xs: list[int]) -> list[int]:
        ran_on.append(threading.current_thread())
        return double(xs)

    f = batchline.aio.dynamically(batch_size=8, timeout_ms=0)(recorded)

    async def once() -> int:
        return int(await f(3))

    assert asyncio.run(once()) == 6
    (thread,) = set(ran_on)
    assert thread is not threading.current_thread()
    f.close()
    thread.join(WAIT_S)
    assert not thread.is_alive()


async def test_async_with_closes() -> None:
    async with batchline.aio.dynamically(timeout_ms=0)(adouble) as f:
        assert await f(2) == 4
    assert f.closed
    with pytest.raises(BatcherClosed):
        await f(2)


async def test_stats() -> None:
    f = batchline.aio.dynamically(batch_size=4, timeout_ms=HUGE_MS)(adouble)
    assert await asyncio.gather(*(f(i) for i in range(8))) == [i * 2 for i in range(8)]
    stats = f.stats
    assert (stats.items, stats.batches, stats.calls) == (8, 2, 8)
    assert dict(stats.batch_size_histogram) == {4: 2}
    assert stats.mean_batch_size == 4.0
    assert stats.errors == 0
    await f.aclose()


# -- methods ---------------------------------------------------------------------------------


class Model:
    def __init__(self, name: str) -> None:
        self.name = name

    @batchline.aio.dynamically(timeout_ms=0)
    async def predict(self, xs: list[int]) -> list[tuple[str, int]]:
        return [(self.name, x) for x in xs]


async def test_methods_get_one_batcher_per_instance() -> None:
    a, b = Model("a"), Model("b")
    assert a.predict is a.predict
    assert a.predict is not b.predict
    assert await a.predict(1) == ("a", 1)
    assert await b.predict([1, 2]) == [("b", 1), ("b", 2)]
    assert a.predict.stats.items == 1
    bound = a.predict
    ref = weakref.ref(a)
    del a
    gc.collect()
    assert ref() is None, "the batcher must not keep its instance alive"
    assert bound.closed
    with pytest.raises(BatcherClosed):
        await bound(1)
    assert await b.predict(3) == ("b", 3)
    await b.predict.aclose()
