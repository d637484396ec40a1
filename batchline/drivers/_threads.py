"""The thread driver: one worker thread per batcher, woken by a condition variable.

Callers on any thread queue their items and block on a lock of their own (``__call__``) or
await a future of their event loop (``acall``). The worker sleeps on the condition until the
policy has a batch or a wake-up time, runs the batch through the isolation and settles the
callers. It never sleep-polls: an idle batcher's thread is blocked in ``wait()``.
"""

from __future__ import annotations

import _thread
import asyncio
import atexit
import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, overload

from batchline.core.isolation import Isolation
from batchline.core.policy import BatchPolicy
from batchline.drivers._base import (
    BatchConfig,
    BatcherBase,
    Call,
    Item,
    abandoned,
    await_call,
    call_args,
    settle_future,
)
from batchline.errors import BatcherClosed

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["ThreadBatcher"]

logger = logging.getLogger(__name__)

_live: weakref.WeakSet[ThreadBatcher[Any, Any]] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for batcher in list(_live):
        batcher._shutdown(BatcherClosed("the interpreter is exiting"), join_s=1.0)


def _settle_threadsafe(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], call: Call
) -> None:
    # A closed loop raises RuntimeError: nobody is waiting there any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle_future, fut, call)


class _Settler:
    """A thread that settles finished batches handed to it (started on first use)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def put(self, settle: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put(settle)

    def _run(self) -> None:
        while (settle := self._queue.get()) is not None:
            try:
                settle()
            except BaseException:  # a waker failed; the other callers must still be woken
                logger.exception("batchline: settling a batch failed")

    def stop(self) -> None:
        """Settle what was handed over, then end (the worker calls this as it ends)."""
        if self._thread is not None:
            self._queue.put(None)

    def join(self, timeout_s: float | None) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


class ThreadBatcher(BatcherBase[T, R]):
    """A batch function wrapped for dynamic batching on a worker thread.

    ``f(x)`` returns one result, ``f([x1, x2])`` a list (spread over as many batches as it
    needs), ``await f.acall(x)`` does the same without blocking an event loop. Both take
    ``timeout_s=`` (relative) or ``deadline=`` (absolute, ``time.monotonic()`` clock): items
    still queued at the deadline are dropped and the call raises RequestTimeout.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        config: BatchConfig,
        *,
        owner: weakref.ref[Any] | None = None,
    ) -> None:
        super().__init__(fn, config, owner=owner)
        self._policy: BatchPolicy[Item] = BatchPolicy(self._policy_config)
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._idle = False
        self._draining = False
        self._settler = _Settler(f"batchline-settle:{self._name}")

    # -- calling -------------------------------------------------------------------------------

    @overload
    def __call__(
        self, items: list[T], /, *, timeout_s: float | None = ..., deadline: float | None = ...
    ) -> list[R]: ...

    @overload
    def __call__(
        self, items: T, /, *, timeout_s: float | None = ..., deadline: float | None = ...
    ) -> R: ...

    def __call__(
        self, items: Any, /, *, timeout_s: float | None = None, deadline: float | None = None
    ) -> Any:
        """Run one item (or a list of items) through the batcher and return its result(s)."""
        many, payloads, deadline = call_args(items, timeout_s, deadline)
        if not payloads:
            return []
        lock = _thread.allocate_lock()
        lock.acquire()
        call = self._submit(payloads, deadline, lambda _call: lock.release())
        try:
            if deadline is None:
                lock.acquire()
            elif not lock.acquire(timeout=max(0.0, deadline - time.monotonic())) and (
                not call.done
            ):
                raise abandoned(call)
        except BaseException:
            call.cancelled = True
            raise
        return call.outcome(many)

    @overload
    async def acall(
        self, items: list[T], /, *, timeout_s: float | None = ..., deadline: float | None = ...
    ) -> list[R]: ...

    @overload
    async def acall(
        self, items: T, /, *, timeout_s: float | None = ..., deadline: float | None = ...
    ) -> R: ...

    async def acall(
        self, items: Any, /, *, timeout_s: float | None = None, deadline: float | None = None
    ) -> Any:
        """Like calling the batcher, but awaited: the event loop stays free meanwhile."""
        many, payloads, deadline = call_args(items, timeout_s, deadline)
        if not payloads:
            return []
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def wake(call: Call) -> None:
            _settle_threadsafe(loop, fut, call)

        return await await_call(fut, self._submit(payloads, deadline, wake), deadline, many)

    def _submit(
        self, payloads: list[Any], deadline: float | None, wake: Callable[[Call], None]
    ) -> Call:
        call, items = self._new_call(payloads, deadline, wake)
        with self._cond:
            must_wake = self._admit(self._policy, items)
            if self._thread is None:
                self._start()
            elif must_wake and self._idle:
                self._cond.notify()
        return call

    # -- the worker ----------------------------------------------------------------------------

    def _start(self) -> None:
        self._thread = threading.Thread(
            target=self._work, name=f"batchline:{self._name}", daemon=True
        )
        _live.add(self)
        self._thread.start()

    def _work(self) -> None:
        try:
            self._serve()
        finally:
            self._settler.stop()

    def _serve(self) -> None:
        policy, cond = self._policy, self._cond
        while True:
            with cond:
                while True:
                    decision = self._poll(policy, flush=self._draining)
                    if decision.batch or decision.expired:
                        break
                    if self._closed and not len(policy):
                        return
                    self._idle = True
                    wake_at = decision.wake_at
                    cond.wait(None if wake_at is None else max(0.0, wake_at - time.monotonic()))
                    self._idle = False
            self._expire(decision.expired)
            batch = decision.batch
            if not batch:
                continue
            try:
                settles = self._run(batch)
            except Exception as exc:  # batchline's own failure: its callers get it, not a hang
                self._fail(batch, exc)
                continue
            if len(policy):
                # More work waits: the settler thread resolves and wakes this batch's callers
                # while the next batch runs, instead of before it starts.
                for settle in settles:
                    self._settler.put(settle)
            else:
                for settle in settles:
                    try:
                        settle()  # nothing waits: no extra hop for a lone call
                    except BaseException:  # the worker thread must outlive any waker
                        logger.exception("batchline: settling a batch failed")

    def _run(self, batch: list[Item]) -> list[Callable[[], None]]:
        """Run one batch through the isolation; what settles its callers, in order."""
        started = time.monotonic()
        run = Isolation(batch, isolate=self._config.isolate_errors)
        settles: list[Callable[[], None]] = []
        while (payloads := run.next()) is not None:
            try:
                outputs = self._invoke(payloads)
            except BaseException as exc:  # isolated per item; the worker carries on
                run.failed(exc)
            else:
                settles.append(run.settle_later(outputs))
        # Recorded before any caller is woken, so a caller sees its batch in the stats.
        self._batch_ran(started, batch, run.durations_s)
        return settles

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop accepting calls; run what is queued (``drain``) or reject it; wait for the worker.

        Args:
            drain: run the queued items first (True) or reject them with BatcherClosed.
            timeout_s: longest to wait for the worker to finish (None: as long as it takes).
        """
        if drain:
            with self._cond:
                self._closed = True
                self._draining = True
                self._cond.notify()
            self._join(timeout_s)
        else:
            self._shutdown(BatcherClosed(f"{self._name} was closed"), join_s=timeout_s)

    async def aclose(self, *, drain: bool = True) -> None:
        """``close`` without blocking the event loop."""
        await asyncio.to_thread(self.close, drain=drain)

    def _shutdown(self, reason: BaseException, join_s: float | None = 0.0) -> None:
        """Reject what is queued and stop the worker; wait for it at most ``join_s`` seconds
        (0 by default: a finalizer must never block the thread that dropped the instance)."""
        with self._cond:
            self._closed = True
            rejected = self._policy.drain()
            self._cond.notify()
        for item in rejected:
            item.reject(reason)
        self._join(join_s)

    def _join(self, timeout_s: float | None) -> None:
        if timeout_s is not None and timeout_s > threading.TIMEOUT_MAX:
            timeout_s = None  # longer than a lock can wait (math.inf): as long as it takes
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if not thread.is_alive():
                self._settler.join(timeout_s)

    def _policies(self) -> list[BatchPolicy[Item]]:
        return [self._policy]

    def _queue_size(self) -> int:
        return len(self._policy)

    def __enter__(self) -> ThreadBatcher[T, R]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> ThreadBatcher[T, R]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
