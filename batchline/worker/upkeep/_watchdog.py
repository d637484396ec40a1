"""The thread that watches a worker's model calls, each against its bound (``max_batch_ms``:
:mod:`batchline.worker.shared._guard`), and a model's loads by demand against theirs
(``max_load_s``; a load past it is hung as a call is, never slow).

The watch. A thread ticks every 0.25 s (a quarter of a smaller fixed bound). It counts how
long a call has run as it sees it, each tick counting at most two periods, so that a process
stopped as a whole (SIGSTOP, a paused virtual machine) does not hold the pause against the
call. Past a quarter of its bound a call is *slow*: the worker hands back the requests it read
ahead and reads nothing more until the call ends, so that other workers serve them meanwhile.
Past its bound the call is *hung*: the worker is marked unhealthy (the ``healthy`` gauge at
once, from this thread) and the event loop is told; the worker then removes itself from the
workers' set (``batchline worker --check`` fails), hands back everything it holds and stops
(see :mod:`batchline.worker.shared._guard`). If the loop does not answer within a second
(the hung call runs on the loop itself), this thread hands back what the worker holds over a
connection of its own and, in ``batchline worker``, ends the process with
:data:`HUNG_EXIT_CODE`, once it has flushed the spans of the requests it handed back
(tracing on).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Literal, Protocol

from batchline.tracing import flush as flush_spans
from batchline.worker.metrics import Metrics
from batchline.worker.shared._guard import CallBound, Stamp, Timing

__all__ = ["HUNG_EXIT_CODE", "SLOW_SHARE", "CallWatch", "Watchdog", "Watched"]

logger = logging.getLogger(__name__)

#: Exit status of a worker process that ended itself because its model hung.
HUNG_EXIT_CODE = 70
#: A call slower than this share of its bound is slow: the worker hands its read-ahead back.
SLOW_SHARE = 0.25
_TICK_S = 0.25
#: How long the watchdog waits for the event loop to take a hung call over.
_LOOP_GRACE_S = 1.0
_REMEMBER_EVERY_S = 1.0


class CallWatch:
    """What the watchdog makes of the model call running, tick by tick: pure, so tests drive
    it with a fake clock.

    Args:
        bound: the calls' bound.
        tick_s: the watchdog's period; one tick counts at most two periods of a call's time.
    """

    def __init__(self, bound: CallBound, *, tick_s: float) -> None:
        self._bound = bound
        self._cap_s = 2 * tick_s
        self._call: Stamp | None = None
        self._last = 0.0
        self._slow = False
        self.ran_s = 0.0  # how long the call watched has run, as far as the watchdog saw
        self.limit_s = 0.0  # its bound, at the last tick

    def tick(self, now: float, call: Stamp | None) -> Literal["idle", "running", "slow", "hung"]:
        """``call`` runs (None: no call) at ``now``: ``slow`` once per call past a quarter
        of its bound, ``hung`` past its bound."""
        last, self._last = self._last, now
        if call is None:
            self._call = None
            return "idle"
        if call is not self._call:  # a new call (every call has a stamp of its own)
            self._call, self._slow = call, False
            self.ran_s = min(max(0.0, now - call[0]), self._cap_s)
        else:
            self.ran_s += min(max(0.0, now - last), self._cap_s)
        self.limit_s = self._bound.limit_s(call[1])
        if self.limit_s <= 0:
            return "running"
        if self.ran_s > self.limit_s:
            return "hung"
        if not self._slow and self.ran_s > SLOW_SHARE * self.limit_s:
            self._slow = True
            return "slow"
        return "running"


class Watched(Protocol):
    """What the watchdog watches: the worker's model calls (its
    :class:`~batchline.worker.shared._guard.Guard`)."""

    #: The calls' bound (the worker times its calls into it).
    bound: CallBound
    #: Set once a call runs past its bound.
    hung: threading.Event
    #: The stamp of the model's load running, None between (None: nothing loads by demand).
    load_stamp: Callable[[], Stamp | None] | None

    @property
    def running(self) -> Stamp | None:
        """The stamp of the model call running (None between calls)."""

    def remember(self, timing: Timing) -> None:
        """Told the slowest recent call as it changes (at most once a second), for the
        next worker process."""

    def abandon_blocked(self) -> None:
        """Hand back what the worker holds from this thread, while a hung call blocks the
        event loop."""


class Watchdog:
    """Watches model calls from a thread of its own (a hung call may block the event loop).

    Args:
        calls: the model calls watched (the worker's guard).
        worker_id: for the log lines.
        metrics: marked unhealthy when a call hangs; told the bound as it changes.
        max_load_s: the bound of a load by demand (0: none).
    """

    def __init__(
        self, calls: Watched, *, worker_id: str, metrics: Metrics, max_load_s: float = 0.0
    ) -> None:
        self.bound = calls.bound
        self.max_load_s = max_load_s
        self._calls = calls
        self._worker_id = worker_id
        self._hung = calls.hung
        self._metrics = metrics

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        on_slow: Callable[[Stamp], None],
        on_hung: Callable[[], None],
        exit_if_loop_blocked: bool,
    ) -> threading.Event:
        """Start watching; returns the event that ends the watch. ``on_slow`` (with the
        slow call's stamp) and ``on_hung`` run on ``loop``; when the loop does not take a
        hung call over, this thread hands back what the worker holds
        (:meth:`Watched.abandon_blocked`)."""
        done = threading.Event()
        bound = self.bound
        watch_calls = bound.auto or bound.fixed_s > 0
        load_stamp = self._calls.load_stamp if self.max_load_s > 0 else None
        if not watch_calls and load_stamp is None:
            return done
        tick_s = min(_TICK_S, bound.fixed_s / 4) if bound.fixed_s > 0 else _TICK_S
        load_bound = CallBound(round(self.max_load_s * 1e3))

        def post(callback: Callable[[], None]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to do
                loop.call_soon_threadsafe(callback)

        def watch() -> None:
            calls = CallWatch(bound, tick_s=tick_s)
            loads = CallWatch(load_bound, tick_s=tick_s)
            follow = (
                _Follow(bound, self._worker_id, self._metrics, self._calls.remember)
                if watch_calls
                else None
            )
            while not done.wait(tick_s):  # a watchdog timer
                now = time.monotonic()
                call = self._calls.running
                state = calls.tick(now, call) if watch_calls else "idle"
                if follow is not None:
                    follow.step()
                if state == "slow" and call is not None:
                    post(functools.partial(on_slow, call))
                elif state == "hung":
                    self._trip(calls, post, on_hung, exit_if_loop_blocked)
                    return
                if load_stamp is not None and loads.tick(now, load_stamp()) == "hung":
                    self._trip(loads, post, on_hung, exit_if_loop_blocked, load=True)
                    return

        threading.Thread(target=watch, name="batchline-watchdog", daemon=True).start()
        return done

    def _trip(
        self,
        calls: CallWatch,
        post: Callable[[Callable[[], None]], None],
        on_hung: Callable[[], None],
        exit_if_loop_blocked: bool,
        *,
        load: bool = False,
    ) -> None:
        what, setting = (
            ("the model's load", f"max_load_s={self.max_load_s:g}")
            if load
            else ("a model call", f"max_batch_ms={self.bound.describe(calls.limit_s)}")
        )
        logger.error(
            "worker %s: %s has run %.1f s, past %s: handing back what it holds and stopping",
            self._worker_id,
            what,
            calls.ran_s,
            setting,
        )
        self._hung.set()
        self._metrics.unhealthy()
        seen = threading.Event()

        def on_loop() -> None:
            seen.set()
            on_hung()

        post(on_loop)
        if seen.wait(_LOOP_GRACE_S):
            return
        logger.error("the hung model call blocks the event loop: handing back from the watchdog")
        try:
            self._calls.abandon_blocked()
        except Exception:  # the loop's own hand-back, or claim_idle_ms, still covers it
            logger.exception("the watchdog could not hand back what the worker holds")
        if exit_if_loop_blocked:
            logger.critical("the hung model call blocks the event loop: exiting")
            with contextlib.suppress(Exception):  # exit whatever the exporter does
                flush_spans()  # the handed-back requests' spans (tracing on)
            logging.shutdown()
            os._exit(HUNG_EXIT_CODE)


class _Follow:
    """On the watchdog's thread: logs the derived bound when it changes a lot (to twice or
    half what was logged), keeps the metrics' gauge current and remembers the slowest call."""

    def __init__(
        self,
        bound: CallBound,
        worker_id: str,
        metrics: Metrics,
        remember: Callable[[Timing], None] | None,
    ) -> None:
        self._bound = bound
        self._worker_id = worker_id
        self._metrics = metrics
        self._remember = remember
        self._shown = bound.limit_s()
        self._slowest: Timing | None = None  # the slowest call remembered
        self._remembered_at = 0.0
        metrics.max_batch_ms(self._shown * 1e3)

    def step(self) -> None:
        bound = self._bound
        if not bound.auto:
            return
        limit = bound.limit_s()
        if not 0.5 * self._shown < limit < 2 * self._shown:
            slowest = bound.slowest()
            logger.info(
                "worker %s: max_batch_ms auto: %.0f ms now (was %.0f ms; slowest recent model "
                "call %.1f ms)",
                self._worker_id,
                limit * 1e3,
                self._shown * 1e3,
                0.0 if slowest is None else slowest[0] * 1e3,
            )
            self._shown = limit
        self._metrics.max_batch_ms(limit * 1e3)
        now = time.monotonic()
        if self._remember is None or now - self._remembered_at < _REMEMBER_EVERY_S:
            return
        slowest, kept = bound.slowest(), self._slowest
        # A new slowest call 20 % away from the one remembered (a file write: not for less).
        if slowest is not None and not (kept and 0.8 * kept[0] < slowest[0] < 1.2 * kept[0]):
            self._slowest, self._remembered_at = slowest, now
            self._remember(slowest)
