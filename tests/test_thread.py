"""``batchline.dynamically``: the thread driver, end to end through the public API."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import batchline
from batchline import (
    BatcherClosed,
    BatchFunctionError,
    QueueFull,
    RequestTimeout,
    ThreadBatcher,
)

HUGE_MS = 600_000.0  # a timeout that never fires in a test: batches flush by size or close

# Generous bound on waiting for something that the test itself makes happen: reaching it
# means the behaviour under test is broken (a hang), never that the machine is slow.
WAIT_S = 30.0


class Gate:
    """Holds a batch function inside its call until the test releases it."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def hold(self) -> None:
        """Called by the batch function: signal entry, then block until released."""
        self.entered.set()
        if not self.release.wait(WAIT_S):
            raise RuntimeError("gate never released")

    def wait_entered(self) -> None:
        assert self.entered.wait(WAIT_S), "the batch function was never called"


def concurrently(fn: Any, args: list[Any]) -> list[concurrent.futures.Future[Any]]:
    """Call ``fn(arg)`` for every arg, each on its own thread, all started together."""
    barrier = threading.Barrier(len(args))

    def one(arg: Any) -> Any:
        barrier.wait(WAIT_S)
        return fn(arg)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(args))
    futures = [pool.submit(one, arg) for arg in args]
    pool.shutdown(wait=False)
    concurrent.futures.wait(futures, timeout=WAIT_S)
    assert all(f.done() for f in futures), "a caller hung"
    return futures


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.release.set()  # never leave a worker blocked behind a failed test


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Batchers appended here are closed (rejecting what is queued) after the test."""
    made: list[Any] = []
    yield made
    for batcher in made:
        batcher.close(drain=False, timeout_s=WAIT_S)


def double(xs: list[int]) -> list[int]:
    return [x * 2 for x in xs]


# -- decorating and calling ------------------------------------------------------------------


def test_bare_decorator(closing: list[Any]) -> None:
    @batchline.dynamically
    def f(xs: list[int]) -> list[int]:
        """Doubles."""
        return double(xs)

    closing.append(f)
    assert isinstance(f, ThreadBatcher)
    assert f.__name__ == "f"
    assert f.__doc__ == "Doubles."
    assert f(3) == 6
    assert f([1, 2, 3]) == [2, 4, 6]
    assert f([]) == []


def test_decorator_with_arguments(closing: list[Any]) -> None:
    @batchline.dynamically(batch_size=4, timeout_ms=1)
    def f(xs: list[int]) -> list[int]:
        return double(xs)

    closing.append(f)
    assert isinstance(f, ThreadBatcher)
    assert f(5) == 10
    assert "batch_size=4" in repr(f)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be an int >= 1, got 0"),
        ({"timeout_ms": -1}, ValueError, "timeout_ms must be a finite number >= 0"),
        ({"timeout_ms": float("inf")}, ValueError, "timeout_ms must be a finite number"),
        ({"timeout_ms": "5"}, TypeError, "timeout_ms must be a number"),
        ({"max_queue_size": 0}, ValueError, "max_queue_size must be an int >= 1"),
        ({"small_batch_threshold": -1}, ValueError, "small_batch_threshold must be"),
        ({"max_tokens": 10}, ValueError, "max_tokens needs length_fn"),
    ],
)
def test_bad_options_are_refused_at_decoration(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        batchline.dynamically(**options)


def test_a_long_list_is_spread_over_batches_in_order(closing: list[Any]) -> None:
    seen: list[int] = []

    @batchline.dynamically(batch_size=32, timeout_ms=0)
    def f(xs: list[int]) -> list[int]:
        seen.append(len(xs))
        return double(xs)

    closing.append(f)
    assert f(list(range(1000))) == [x * 2 for x in range(1000)]
    assert sum(seen) == 1000
    assert max(seen) <= 32
    assert len(seen) >= 32  # ceil(1000 / 32)
    stats = f.stats
    assert stats.items == 1000
    assert stats.calls == 1


async def test_acall(closing: list[Any]) -> None:
    f = batchline.dynamically(double)
    closing.append(f)
    assert await f.acall(4) == 8
    assert await f.acall([1, 2]) == [2, 4]
    assert await f.acall([]) == []
    results = await asyncio.gather(*(f.acall(i) for i in range(50)))
    assert results == [i * 2 for i in range(50)]


def test_lone_call_with_zero_timeout_returns(closing: list[Any]) -> None:
    f = batchline.dynamically(timeout_ms=0)(double)
    closing.append(f)
    for i in range(20):
        assert f(i) == 2 * i


def test_many_threads_at_once_all_get_their_own_results(closing: list[Any]) -> None:
    sizes: list[int] = []

    @batchline.dynamically(batch_size=8, timeout_ms=1)
    def f(xs: list[Any]) -> list[Any]:
        sizes.append(len(xs))
        return [(x, threading.get_ident()) for x in xs]

    closing.append(f)
    args: list[Any] = [i if i % 3 else [i, i + 1000] for i in range(32)]
    futures = concurrently(f, args)
    for arg, fut in zip(args, futures, strict=True):
        got = fut.result()
        if isinstance(arg, list):
            assert [x for x, _ in got] == arg
        else:
            assert got[0] == arg
    assert max(sizes) <= 8
    assert sum(sizes) == sum(len(a) if isinstance(a, list) else 1 for a in args)


# -- methods ---------------------------------------------------------------------------------


class Model:
    def __init__(self, name: str) -> None:
        self.name = name
        self.threads: list[threading.Thread] = []

    @batchline.dynamically(timeout_ms=0)
    def predict(self, xs: list[int]) -> list[tuple[str, int]]:
        self.threads.append(threading.current_thread())
        return [(self.name, x) for x in xs]


class SlottedModel:
    __slots__ = ("__weakref__", "name")

    def __init__(self, name: str) -> None:
        self.name = name

    @batchline.dynamically(timeout_ms=0)
    def predict(self, xs: list[int]) -> list[tuple[str, int]]:
        return [(self.name, x) for x in xs]


@pytest.mark.parametrize("cls", [Model, SlottedModel])
def test_methods_get_one_batcher_per_instance(cls: type[Any]) -> None:
    a, b = cls("a"), cls("b")
    assert isinstance(cls.predict, ThreadBatcher)
    assert a.predict is a.predict
    assert a.predict is not b.predict
    assert a.predict(1) == ("a", 1)
    assert b.predict([1, 2]) == [("b", 1), ("b", 2)]
    assert a.predict.stats.items == 1
    assert b.predict.stats.items == 2
    assert cls.predict.stats.items == 0, "the class-level descriptor runs nothing itself"
    a.predict.close()
    b.predict.close()


def test_an_instance_is_freed_and_its_worker_exits() -> None:
    model = Model("m")
    bound = model.predict
    assert bound([1, 2]) == [("m", 1), ("m", 2)]
    other = Model("o")
    other.predict(0)
    worker = model.threads[0]
    assert worker is not other.threads[0], "each instance has its own worker"
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None, "the batcher must not keep its instance alive"
    worker.join(WAIT_S)
    assert not worker.is_alive()
    assert bound.closed
    with pytest.raises(BatcherClosed):
        bound(3)
    assert other.predict(5) == ("o", 5), "other instances are unaffected"
    other.predict.close()


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


# -- lifecycle -------------------------------------------------------------------------------


def _queue_three(f: Any) -> tuple[asyncio.AbstractEventLoop, list[asyncio.Future[Any]]]:
    """Queue three calls of ``f`` from a fresh event loop; they wait (huge timeout)."""
    loop = asyncio.new_event_loop()
    tasks = [loop.create_task(f.acall(i)) for i in range(3)]
    loop.run_until_complete(asyncio.sleep(0))  # each task's first step queued its item
    assert f.stats.queue_size == 3
    return loop, tasks


def _outcomes(loop: asyncio.AbstractEventLoop, tasks: list[asyncio.Future[Any]]) -> list[Any]:
    async def collect() -> list[Any]:
        async with asyncio.timeout(WAIT_S):
            return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        return loop.run_until_complete(collect())
    finally:
        loop.close()


def test_close_with_drain_runs_what_is_queued() -> None:
    seen: list[int] = []

    @batchline.dynamically(batch_size=8, timeout_ms=HUGE_MS)
    def f(xs: list[int]) -> list[int]:
        seen.extend(xs)
        return double(xs)

    loop, tasks = _queue_three(f)
    f.close(drain=True, timeout_s=WAIT_S)
    assert sorted(seen) == [0, 1, 2], "close(drain=True) flushed the queue"
    assert _outcomes(loop, tasks) == [0, 2, 4]
    assert f.closed
    with pytest.raises(BatcherClosed):
        f(1)


def test_close_without_drain_rejects_what_is_queued() -> None:
    seen: list[int] = []

    @batchline.dynamically(batch_size=8, timeout_ms=HUGE_MS)
    def f(xs: list[int]) -> list[int]:
        seen.extend(xs)
        return double(xs)

    loop, tasks = _queue_three(f)
    f.close(drain=False, timeout_s=WAIT_S)
    outcomes = _outcomes(loop, tasks)
    assert all(isinstance(o, BatcherClosed) for o in outcomes)
    assert seen == []
    assert f.stats.errors == 3


def test_a_call_after_close_is_refused_and_counted() -> None:
    f = batchline.dynamically(double)
    assert f(1) == 2
    f.close()
    with pytest.raises(BatcherClosed, match="closed"):
        f(2)
    with pytest.raises(BatcherClosed):
        asyncio.run(f.acall(2))
    assert f.stats.rejected == 2
    assert "closed" in repr(f)


def test_close_before_any_call_and_twice() -> None:
    f = batchline.dynamically(double)
    f.close()
    f.close()
    with pytest.raises(BatcherClosed):
        f(1)


def test_with_block_closes() -> None:
    with batchline.dynamically(timeout_ms=0)(double) as f:
        assert f(2) == 4
    assert f.closed
    with pytest.raises(BatcherClosed):
        f(2)


async def test_async_with_block_closes() -> None:
    async with batchline.dynamically(timeout_ms=0)(double) as f:
        assert await f.acall(2) == 4
    assert f.closed


def test_close_waits_for_the_running_batch(gate: Gate) -> None:
    @batchline.dynamically(batch_size=1, timeout_ms=0)
    def f(xs: list[int]) -> list[int]:
        gate.hold()
        return double(xs)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    running = pool.submit(f, 1)
    gate.wait_entered()
    closer = threading.Thread(target=f.close, kwargs={"drain": False})
    closer.start()
    closer.join(0.05)
    assert closer.is_alive(), "close() waits while the function still runs"
    gate.release.set()
    closer.join(WAIT_S)
    assert not closer.is_alive()
    assert running.result(WAIT_S) == 2, "the running batch finishes and settles its callers"
    pool.shutdown()


# -- statistics ------------------------------------------------------------------------------


async def test_stats_count_items_batches_sizes_and_errors(closing: list[Any]) -> None:
    @batchline.dynamically(batch_size=4, timeout_ms=HUGE_MS)
    def f(xs: list[int]) -> list[int]:
        if -1 in xs:
            raise ValueError("negative")
        return double(xs)

    closing.append(f)
    assert await asyncio.gather(*(f.acall(i) for i in range(8))) == [i * 2 for i in range(8)]
    outcomes = await asyncio.gather(*(f.acall(i) for i in (-1, 20, 21, 22)), return_exceptions=True)
    assert isinstance(outcomes[0], ValueError)
    assert outcomes[1:] == [40, 42, 44]
    stats = f.stats
    assert stats.items == 12
    assert stats.batches == 3
    assert stats.mean_batch_size == 4.0
    assert dict(stats.batch_size_histogram) == {4: 3}
    assert stats.calls == 12
    assert stats.errors == 1
    assert stats.rejected == 0
    assert stats.queue_size == 0
    assert stats.latency_ms.samples == 12
    assert stats.queue_wait_ms.samples == 12
    assert stats.function_ms.samples >= 3
    assert stats.padding_efficiency is None


# -- an idle batcher does not poll -----------------------------------------------------------


def _voluntary_switches(thread: threading.Thread) -> int | None:
    path = Path(f"/proc/self/task/{thread.native_id}/status")
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    return None


@pytest.mark.parametrize("timeout_ms", [0, 5])
def test_an_idle_batcher_is_blocked_not_polling(timeout_ms: float, closing: list[Any]) -> None:
    workers: list[threading.Thread] = []

    @batchline.dynamically(timeout_ms=timeout_ms)
    def f(xs: list[int]) -> list[int]:
        workers.append(threading.current_thread())
        return double(xs)

    closing.append(f)
    assert f(1) == 2
    worker = workers[0]
    switches_before = _voluntary_switches(worker)
    cpu_before = time.process_time()
    time.sleep(0.3)  # a measurement window, not a wait for an event
    cpu_used = time.process_time() - cpu_before
    assert cpu_used < 0.02, f"an idle batcher used {cpu_used:.3f} s of CPU in 0.3 s"
    if switches_before is not None:
        woken = (_voluntary_switches(worker) or 0) - switches_before
        assert woken <= 3, f"the idle worker woke {woken} times in 0.3 s"


# -- interpreter exit ------------------------------------------------------------------------

_EXIT_SCRIPT = textwrap.dedent(
    """
    import asyncio
    import threading
    import batchline

    @batchline.dynamically(timeout_ms=0)
    def f(xs):
        return [x + 1 for x in xs]

    @batchline.dynamically(batch_size=8, timeout_ms=600_000)
    def idle(xs):
        return xs

    class M:
        @batchline.dynamically(timeout_ms=0)
        def g(self, xs):
            return xs

    @batchline.aio.dynamically(timeout_ms=0)
    def on_loop(xs):  # a plain function: runs on the asyncio batcher's own thread
        return xs

    m = M()
    assert asyncio.run(on_loop(4)) == 4
    assert f(1) == 2
    assert f([1, 2]) == [2, 3]
    assert m.g(3) == 3

    # One call left waiting in a queue at exit: close() at exit must reject it, not hang.
    def waiter():
        try:
            idle(1)
        except batchline.BatcherClosed:
            pass

    threading.Thread(target=waiter, daemon=True).start()
    print("ok")
    """
)


def test_the_interpreter_exits_promptly_and_cleanly() -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        env=env,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout == "ok\n"


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


def test_latency_slo_mode_chooses_its_settings_within_the_limits() -> None:
    @batchline.dynamically(batch_size=64, timeout_ms=20.0, target_p99_ms=10.0)
    def double(xs: list[int]) -> list[int]:
        return [2 * x for x in xs]

    assert double.stats.target_p99_ms == 10.0
    # Before any batch: the largest batch, no wait (until the function's time is known).
    assert (double.stats.batch_size, double.stats.timeout_ms) == (64, 0.0)
    assert [double(i) for i in range(200)] == [2 * i for i in range(200)]
    stats = double.stats
    # One call at a time: a 20 ms wait for company would break a 10 ms target; the
    # controller waits at most what the target leaves after twice the batch's time.
    assert stats.timeout_ms < 10.0
    assert 1 <= stats.batch_size <= 64
    double.close()


@pytest.mark.parametrize("bad", [0, -5.0, float("inf"), float("nan")])
def test_latency_slo_target_must_be_positive_and_finite(bad: float) -> None:
    with pytest.raises(ValueError, match="target_p99_ms"):
        batchline.dynamically(lambda xs: xs, target_p99_ms=bad)
    with pytest.raises(TypeError, match="target_p99_ms"):
        batchline.dynamically(lambda xs: xs, target_p99_ms="5")  # type: ignore[arg-type]
