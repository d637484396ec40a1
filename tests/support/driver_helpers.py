"""What the driver tests share: doubling batch functions, gates that hold a batch function
inside its call until the test opens them, calls started together on many threads, and the
timeouts they use; for test_thread_*.py and test_aio_*.py (the thread driver's fixtures are
in tests/drivers/conftest.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

HUGE_MS = 600_000.0  # a timeout that never fires in a test: batches flush by size or close

# Generous bound on waiting for something that the test itself makes happen: reaching it
# means the behaviour under test is broken (a hang), never that the machine is slow.
WAIT_S = 30.0


def double(xs: list[int]) -> list[int]:
    return [x * 2 for x in xs]


async def adouble(xs: list[int]) -> list[int]:
    await asyncio.sleep(0)
    return [x * 2 for x in xs]


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


class AsyncGate:
    """Holds a coroutine batch function until the test opens it (same loop)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def hold(self) -> None:
        self.entered.set()
        await self.release.wait()
