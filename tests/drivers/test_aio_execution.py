"""``batchline.aio.dynamically``, the asyncio driver: where a plain batch function runs
(its thread, or the loop once it has been quick: ``inline_below_ms``), and the driver's
public knobs that the worker uses (``max_concurrent_batches``, ``on_batch_start``, a shared
``lock``)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

import batchline
from batchline import AioBatcher
from batchline.drivers._base import BatchConfig

from tests.support.driver_helpers import HUGE_MS, double

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
