"""``batchline.dynamically``, the thread driver: its lifecycle (close with and without
draining the queue, ``with`` blocks, close waiting for the running batch), an idle batcher
blocked rather than polling, and a prompt, clean interpreter exit; end to end through the
public API."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import batchline
from batchline import BatcherClosed

from tests.support.driver_helpers import HUGE_MS, WAIT_S, Gate, double

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
    root = Path(__file__).resolve().parents[2]
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
