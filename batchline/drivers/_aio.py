"""The asyncio driver: one worker task per batcher per event loop, woken by a future.

Callers ``await f(x)``. Each event loop that calls the batcher gets its own queue and worker
task, so the batcher works across loops in turn (``asyncio.run`` twice, per-test loops) and a
loop that shuts down cancels only its own task, which rejects what that loop had queued. A
coroutine batch function is awaited on the loop; a plain one runs on a thread of the
batcher's own, so the loop stays free while it computes, unless its calls have been quick
(:class:`~batchline.core.pace.Pace`): then it runs on the loop, which is cheaper.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import queue
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

from batchline.core.isolation import Isolation
from batchline.core.pace import Pace
from batchline.core.policy import BatchPolicy
from batchline.drivers._base import (
    BatchConfig,
    BatcherBase,
    Call,
    Item,
    await_call,
    call_args,
    settle_future,
)
from batchline.errors import BatcherClosed

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["AioBatcher"]


_DONE = object()  # the run had nothing left to call the function with


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _deliver(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if not fut.done():
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)


class _FunctionThread:
    """The thread a plain batch function runs on (started on first use).

    Lighter than ``run_in_executor``: a queue in, one ``call_soon_threadsafe`` out per batch.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[
            tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[[Any], Any], Any] | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[[Any], Any], arg: Any
    ) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue.put((loop, fut, fn, arg))
        return fut

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            loop, fut, fn, arg = job
            try:
                result: tuple[bool, Any] = (True, fn(arg))
            except BaseException as exc:  # handed to the loop, which isolates it
                result = (False, exc)
            # A closed loop raises RuntimeError: nobody waits for this batch any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver, fut, *result)
            # Not held while waiting for the next (what the call ran may be freed meanwhile).
            del job, loop, fut, fn, arg, result

    def stop(self) -> None:
        """End after the batches already handed over."""
        self._queue.put(None)


class _LoopState:
    """One event loop's queue, worker task and wake-up future.

    It never refers to its loop (it is the value of a WeakKeyDictionary keyed by the loop,
    which a reference back would keep alive forever).
    """

    __slots__ = ("policy", "task", "waiter")

    def __init__(self, policy: BatchPolicy[Item]) -> None:
        self.policy = policy
        self.task: asyncio.Task[None] | None = None
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        if self.waiter is not None:
            _wake(self.waiter)


class AioBatcher(BatcherBase[T, R]):
    """A batch function wrapped for dynamic batching on asyncio.

    ``await f(x)`` returns one result, ``await f([x1, x2])`` a list. Both take ``timeout_s=``
    or ``deadline=`` (``time.monotonic()`` clock): items still queued at the deadline are
    dropped and the call raises RequestTimeout; a cancelled caller's items are dropped too.

    Args:
        fn: the batch function.
        config: the batcher's settings.
        owner: the instance a method's batcher belongs to (held weakly).
        max_concurrent_batches: batches in flight at once for a plain function: 2 hands one
            more *full* batch to the function's thread while a batch runs (it starts the
            moment the first ends); 1 forms each batch only when the function is free (for
            a caller that checks its items as a batch starts, as the worker does). A
            coroutine function always runs one batch at a time.
        on_batch_start: awaited with a batch's items as they leave the queue, before the
            function sees them; it may reject items (they are then not run).
        lock: held around every call of a plain function (default: a lock of its own);
            batchers given one lock never run their functions at once (the worker's two
            batchers of one model).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        config: BatchConfig,
        *,
        owner: weakref.ref[Any] | None = None,
        max_concurrent_batches: int = 2,
        on_batch_start: Callable[[list[Item]], Awaitable[None]] | None = None,
        lock: threading.Lock | None = None,
    ) -> None:
        super().__init__(fn, config, owner=owner)
        if max_concurrent_batches not in (1, 2):
            raise ValueError(f"max_concurrent_batches must be 1 or 2, got {max_concurrent_batches}")
        self._max_concurrent = max_concurrent_batches
        self._on_batch_start = on_batch_start
        self._states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = (
            weakref.WeakKeyDictionary()
        )
        self._states_lock = threading.Lock()
        # The last loop's state, found without a WeakKeyDictionary lookup on every call.
        self._last: tuple[weakref.ref[asyncio.AbstractEventLoop], _LoopState] | None = None
        self._is_coroutine = inspect.iscoroutinefunction(fn)
        self._thread: _FunctionThread | None = None
        # Calls of a plain function never overlap: on its thread or inline, each holds this.
        self._fn_lock = lock if lock is not None else threading.Lock()
        self._pace = Pace(config.inline_below_ms / 1e3)
        self._draining = False

    # -- calling -------------------------------------------------------------------------------

    @overload
    async def __call__(
        self, items: list[T], /, *, timeout_s: float | None = ..., deadline: float | None = ...
    ) -> list[R]: ...

    @overload
    async def __call__(
        self, items: T, /, *, timeout_s: float | None = ..., deadline: float | None = ...
    ) -> R: ...

    async def __call__(
        self, items: Any, /, *, timeout_s: float | None = None, deadline: float | None = None
    ) -> Any:
        """Run one item (or a list of items) through the batcher and return its result(s)."""
        many, payloads, deadline = call_args(items, timeout_s, deadline)
        if not payloads:
            return []
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        call = self.enqueue(payloads, functools.partial(settle_future, fut), deadline=deadline)
        if deadline is not None:
            return await await_call(fut, call, deadline, many)
        try:  # the common case, without await_call's extra coroutine
            results = await fut
        except BaseException:
            call.cancelled = True
            raise
        return results if many else results[0]

    def enqueue(
        self,
        payloads: list[Any],
        wake: Callable[[Call], None],
        *,
        deadline: float | None = None,
        priority: int = 0,
    ) -> Call:
        """Queue a call without awaiting it; ``wake(call)`` runs on this loop once it is settled.

        The low-level entry that ``__call__`` and the Redis worker share. Must be called on
        the event loop that will run the batches. Raises QueueFull, ItemTooLarge or
        BatcherClosed before anything is queued.
        """
        loop = asyncio.get_running_loop()
        state = self._state(loop)
        call, queued = self._new_call(payloads, deadline, wake)
        if priority:
            for item in queued:
                item.priority = priority
        if self._admit(state.policy, queued):
            state.wake()
        if state.task is None:
            state.task = loop.create_task(self._work(state), name=f"batchline:{self._name}")
        return call

    def _state(self, loop: asyncio.AbstractEventLoop) -> _LoopState:
        last = self._last  # one read: loops on other threads may replace it meanwhile
        if last is not None and last[0]() is loop:
            return last[1]
        state = self._states.get(loop)
        if state is None:
            with self._states_lock:
                state = self._states.get(loop)
                if state is None:
                    state = _LoopState(BatchPolicy(self._policy_config))
                    self._states[loop] = state
        self._last = (weakref.ref(loop), state)
        return state

    # -- the worker ----------------------------------------------------------------------------

    async def _work(self, state: _LoopState) -> None:
        """Run batches as the policy hands them out.

        A coroutine function runs one batch at a time. A plain function runs on the batcher's
        thread; while it runs a batch, one more *full* batch may be handed to that thread, so
        it starts the moment the first ends instead of after the loop has settled 32 callers
        (a partial batch still waits for the function to be free, so batches keep growing).
        """
        policy = state.policy
        running: collections.deque[asyncio.Task[None]] = collections.deque()
        pipeline = self._max_concurrent > 1 and not self._is_coroutine
        try:
            while True:
                while running and running[0].done():
                    running.popleft().result()
                if len(running) >= self._max_concurrent:
                    await asyncio.wait([running[0]])
                    continue
                decision = self._poll(policy, flush=self._draining, full_only=bool(running))
                self._expire(decision.expired)
                if decision.batch:
                    if pipeline:
                        task = asyncio.get_running_loop().create_task(self._run(decision.batch))
                        task.add_done_callback(lambda _task: state.wake())
                        running.append(task)
                    else:
                        await self._run(decision.batch)
                elif self._closed and not len(policy) and not running:
                    self._release_thread()  # the next batch (another loop's) starts another
                    return
                elif not decision.expired:
                    await self._sleep(state, decision.wake_at)
        except asyncio.CancelledError:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            for item in policy.drain():
                item.reject(BatcherClosed(f"{self._name}: its event loop is shutting down"))
            if self._closed:
                self._release_thread()
            raise
        finally:
            state.task = None

    async def _sleep(self, state: _LoopState, wake_at: float | None) -> None:
        loop = asyncio.get_running_loop()
        waiter = state.waiter = loop.create_future()
        timer = None
        if wake_at is not None:
            timer = loop.call_at(loop.time() + (wake_at - time.monotonic()), _wake, waiter)
        try:
            await waiter
        finally:
            state.waiter = None
            if timer is not None:
                timer.cancel()

    async def _run(self, batch: list[Item]) -> None:
        try:
            await self._run_batch(batch)
        except Exception as exc:  # batchline's own failure: its callers get it, not a hang
            self._fail(batch, exc)

    async def _run_batch(self, batch: list[Item]) -> None:
        started = time.monotonic()
        if self._on_batch_start is not None:
            await self._on_batch_start(batch)
        run = Isolation(batch, isolate=self._config.isolate_errors)
        try:
            while True:
                try:
                    outputs = await self._next_outputs(run)
                except asyncio.CancelledError as exc:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise
                    run.failed(exc)  # raised by the function itself, not our cancellation
                except BaseException as exc:  # isolated per item; the worker carries on
                    run.failed(exc)
                else:
                    if outputs is _DONE:
                        break
                    try:
                        run.succeeded(outputs)
                    except Exception as exc:  # a waker failed; the rest must still settle
                        run.abort(exc)
                if run.exhausted:
                    break
        except asyncio.CancelledError:
            run.abort(BatcherClosed(f"{self._name}: its event loop is shutting down"))
            raise
        finally:
            self._batch_ran(started, batch, run.durations_s)

    async def _next_outputs(self, run: Isolation[Item]) -> Any:
        """The function's outputs for the run's next payloads, or _DONE.

        For a plain function the payloads are picked on its thread, right before it runs:
        a batch handed over while another one runs still drops the callers that left (timed
        out, cancelled) while it waited. A plain function that has been quick (see
        :class:`~batchline.core.pace.Pace`) runs here, on the loop, instead.
        """
        if self._is_coroutine:
            payloads = run.next()
            outputs = _DONE if payloads is None else self._invoke(payloads)
        elif self._pace.inline and self._fn_lock.acquire(blocking=False):
            try:  # quick enough to run here: cheaper than the round trip to its thread
                outputs = self._call(run)
            finally:
                self._fn_lock.release()
        else:
            loop = asyncio.get_running_loop()
            outputs = await self._function_thread().submit(loop, self._step, run)
        if inspect.isawaitable(outputs):
            outputs = await outputs
        return outputs

    def _step(self, run: Isolation[Item]) -> Any:
        """The function's outputs for the run's next payloads (on the function's thread)."""
        with self._fn_lock:
            return self._call(run)

    def _call(self, run: Isolation[Item]) -> Any:
        """Call the plain function, timing it for the pace; the caller holds ``_fn_lock``."""
        payloads = run.next()
        if payloads is None:
            return _DONE
        started = time.perf_counter()
        try:
            return self._invoke(payloads)
        except StopIteration as exc:  # neither a future nor a coroutine can carry it
            raise RuntimeError(f"the batch function raised StopIteration: {exc}") from exc
        finally:
            self._pace.observe(time.perf_counter() - started)

    def _function_thread(self) -> _FunctionThread:
        if self._thread is None:
            self._thread = _FunctionThread(f"batchline:{self._name}")
        return self._thread

    def keep_off_loop(self) -> None:
        """Run a plain function on the batcher's thread from now on, never inline on the
        event loop (its calls wait for something that needs the loop free: a worker's
        coroutine model, or its turn among other queues' calls)."""
        self._pace = Pace(0.0)

    # -- lifecycle -----------------------------------------------------------------------------

    async def aclose(self, *, drain: bool = True) -> None:
        """Stop accepting calls; run (``drain``) or reject what is queued, then wait for it.

        Waits for this event loop's queue; queues of other loops are drained or rejected by
        their own loops.
        """
        self.close(drain=drain)
        state = self._states.get(asyncio.get_running_loop())
        if drain and state is not None and state.task is not None:
            await asyncio.shield(state.task)

    def close(self, *, drain: bool = True) -> None:
        """Stop accepting calls; run (``drain``) what is queued, or reject it with
        BatcherClosed. From any thread, and without waiting: each event loop's worker runs
        what its loop queued as that loop goes on (a loop that shuts down first rejects
        it); ``await aclose()`` waits for its loop's."""
        if not drain:
            self._shutdown(BatcherClosed(f"{self._name} was closed"))
            return
        self._closed = True
        self._draining = True
        self._signal_all(None)
        live = [s for loop, s in list(self._states.items()) if s.task and not loop.is_closed()]
        if not live:  # no worker left to drain anything and end the thread as it returns
            self._release_thread()

    def _shutdown(self, reason: BaseException) -> None:
        self._closed = True
        self._signal_all(reason)
        self._release_thread()

    def _signal_all(self, reason: BaseException | None) -> None:
        """Wake every loop's worker; with a ``reason``, reject what each loop has queued."""
        for loop, state in list(self._states.items()):
            if loop.is_closed():
                continue
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                self._reject_and_wake(state, reason)
            else:
                loop.call_soon_threadsafe(self._reject_and_wake, state, reason)

    @staticmethod
    def _reject_and_wake(state: _LoopState, reason: BaseException | None) -> None:
        if reason is not None:
            for item in state.policy.drain():
                item.reject(reason)
        state.wake()

    def _release_thread(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None

    def _policies(self) -> list[BatchPolicy[Item]]:
        return [state.policy for state in list(self._states.values())]

    def _queue_size(self) -> int:
        return sum(len(state.policy) for state in list(self._states.values()))

    def __enter__(self) -> AioBatcher[T, R]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> AioBatcher[T, R]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
