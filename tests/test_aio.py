"""``batchline.aio.dynamically``: the asyncio driver, end to end through the public API."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from typing import Any

import pytest

import batchline
from batchline import AioBatcher, BatcherClosed, BatchFunctionError, QueueFull, RequestTimeout
from batchline.drivers._base import BatchConfig

HUGE_MS = 600_000.0  # never fires in a test: batches flush by size or by close


async def adouble(xs: list[int]) -> list[int]:
    await asyncio.sleep(0)
    return [x * 2 for x in xs]


def double(xs: list[int]) -> list[int]:
    return [x * 2 for x in xs]


class AsyncGate:
    """Holds a coroutine batch function until the test opens it (same loop)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def hold(self) -> None:
        self.entered.set()
        await self.release.wait()


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
        f.close()
    else:
        await asyncio.to_thread(f.close)
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(o, BatcherClosed) for o in outcomes)
    assert seen == []
    assert f.closed


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


# -- where a plain function runs: its thread, or the loop once it has been quick ------------


async def test_a_quick_plain_function_moves_onto_the_loop() -> None:
    threads: list[threading.Thread] = []

    # Every call counts as quick under a 1 s bound: after 16 of them it runs on the loop.
    @batchline.aio.dynamically(batch_size=1, timeout_ms=0, inline_below_ms=1000)
    def f(xs: list[int]) -> list[int]:
        threads.append(threading.current_thread())
        return double(xs)

    for i in range(20):
        assert await f(i) == 2 * i
    loop_thread = threading.current_thread()
    assert all(t is not loop_thread for t in threads[:16]), "the first 16 on its thread"
    assert all(t is loop_thread for t in threads[16:]), "then on the loop"
    await f.aclose()


async def test_one_slow_call_sends_it_back_to_its_thread() -> None:
    threads: list[threading.Thread] = []
    slow = {5}

    @batchline.aio.dynamically(batch_size=1, timeout_ms=0, inline_below_ms=50)
    def f(xs: list[int]) -> list[int]:
        threads.append(threading.current_thread())
        if xs[0] in slow:
            time.sleep(0.1)  # twice the bound: certainly not quick
        return double(xs)

    loop_thread = threading.current_thread()
    for i in range(16):
        await f(100 + i)
    assert threads[-1] is not loop_thread
    assert await f(1) == 2
    assert threads[-1] is loop_thread  # 16 quick calls in a row: inline
    assert await f(5) == 10  # slow, inline: the one call that holds the loop
    for i in range(16):
        await f(200 + i)
    assert all(t is not loop_thread for t in threads[-16:]), "16 calls back on its thread"
    await f(3)
    assert threads[-1] is loop_thread
    await f.aclose()


async def test_inline_below_ms_zero_keeps_it_on_its_thread() -> None:
    threads: list[threading.Thread] = []

    @batchline.aio.dynamically(batch_size=1, timeout_ms=0, inline_below_ms=0)
    def f(xs: list[int]) -> list[int]:
        threads.append(threading.current_thread())
        return xs

    for i in range(40):
        await f(i)
    assert all(t is not threading.current_thread() for t in threads)
    await f.aclose()


async def test_calls_never_overlap_on_the_thread_and_the_loop() -> None:
    active = 0
    most = 0
    guard = threading.Lock()

    @batchline.aio.dynamically(batch_size=8, timeout_ms=0, inline_below_ms=1000)
    def f(xs: list[int]) -> list[int]:
        nonlocal active, most
        with guard:
            active += 1
            most = max(most, active)
        time.sleep(0)  # let another thread in, if one could be running
        with guard:
            active -= 1
        return double(xs)

    results = await asyncio.gather(*(f(i) for i in range(3000)))
    assert results == [2 * i for i in range(3000)]
    assert most == 1
    await f.aclose()


async def test_an_inline_stop_iteration_fails_its_callers_only() -> None:
    @batchline.aio.dynamically(batch_size=1, timeout_ms=0, inline_below_ms=1000)
    def f(xs: list[int]) -> list[int]:
        if xs[0] < 0:
            raise StopIteration("no more")
        return double(xs)

    for i in range(20):  # onto the loop
        await f(i)
    with pytest.raises(RuntimeError, match="StopIteration"):
        await f(-1)
    assert await f(4) == 8
    await f.aclose()


def test_inline_below_ms_is_validated() -> None:
    with pytest.raises(ValueError, match="inline_below_ms"):
        batchline.aio.dynamically(inline_below_ms=-1)(double)


# -- the driver's public knobs (what the worker uses) ----------------------------------------


@pytest.mark.parametrize("max_concurrent", [1, 2])
async def test_max_concurrent_batches_and_on_batch_start(max_concurrent: int) -> None:
    """With 2, a second full batch leaves the queue while the first runs; with 1 it waits."""
    release = threading.Event()
    started: list[list[int]] = []
    left_queue = asyncio.Event()
    first_started = asyncio.Event()

    def hold(xs: list[int]) -> list[int]:
        release.wait(timeout=60)
        return xs

    async def on_start(batch: list[Any]) -> None:
        started.append([item.payload for item in batch])
        first_started.set()
        if len(started) == 2:
            left_queue.set()

    f = AioBatcher(
        hold,
        BatchConfig(batch_size=2, timeout_ms=HUGE_MS, inline_below_ms=0),
        max_concurrent_batches=max_concurrent,
        on_batch_start=on_start,
    )
    first = asyncio.ensure_future(f([1, 2]))
    await asyncio.wait_for(first_started.wait(), 30)
    second = asyncio.ensure_future(f([3, 4]))
    await asyncio.sleep(0.05)  # room for a wrong hand-off to happen; not needed to pass
    if max_concurrent == 2:
        await asyncio.wait_for(left_queue.wait(), 30)
        assert f.queue_size == 0
    else:
        assert started == [[1, 2]]
        assert f.queue_size == 2
    release.set()
    assert await first == [1, 2]
    assert await second == [3, 4]
    assert started == [[1, 2], [3, 4]]
    await f.aclose()


async def test_on_batch_start_may_reject_items() -> None:
    ran: list[list[int]] = []

    def fn(xs: list[int]) -> list[int]:
        ran.append(xs)
        return xs

    async def reject_odd(batch: list[Any]) -> None:
        for item in batch:
            if item.payload % 2:
                item.call.reject(ValueError(f"odd {item.payload}"))

    f = AioBatcher(fn, BatchConfig(batch_size=4, timeout_ms=HUGE_MS), on_batch_start=reject_odd)
    results = await asyncio.gather(*(f(x) for x in range(4)), return_exceptions=True)
    assert results[0] == 0
    assert results[2] == 2
    assert isinstance(results[1], ValueError)
    assert isinstance(results[3], ValueError)
    assert ran == [[0, 2]]
    await f.aclose()


def test_max_concurrent_batches_is_validated() -> None:
    with pytest.raises(ValueError, match="max_concurrent_batches must be 1 or 2, got 3"):
        AioBatcher(double, BatchConfig(), max_concurrent_batches=3)


async def test_batchers_given_one_lock_never_run_their_functions_at_once() -> None:
    """The worker's two batchers of one model share its lock (``lock=``)."""
    lock = threading.Lock()
    held: list[bool] = []

    def fn(xs: list[int]) -> list[int]:
        held.append(lock.locked())  # the batcher holds it around each call
        return double(xs)

    config = BatchConfig(batch_size=1, timeout_ms=0, inline_below_ms=0)
    a, b = AioBatcher(fn, config, lock=lock), AioBatcher(fn, config, lock=lock)
    with lock:  # as a batch of another batcher would
        call = asyncio.ensure_future(a(1))
        await asyncio.sleep(0.05)  # room for a call past the lock to happen; not needed to pass
        assert not call.done()
    assert await call == 2
    assert await b(2) == 4
    assert held == [True, True]
    await a.aclose()
    await b.aclose()
