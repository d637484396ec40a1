"""How long one model call may run (``max_batch_ms``), and the thread that watches the calls.

The bound. ``max_batch_ms`` is a number of milliseconds (0: no bound), or ``auto`` (the
default): derived from what the worker measures itself. Every model call (a batch; for a
generation worker, a step) is timed together with its *work*: the padded tokens of its batch
for a model that pads, its items' lengths summed for one that does not (a ``module:callable``
model: characters of a text, entries of a list, else 1 per item), none for a step. The bound of
a call is :data:`FACTOR` times the slowest of the recent calls, scaled up in proportion where
the call at hand has more work than that one had, and at least :data:`FLOOR_S`:

- *recent*: the last 1,024 calls (the oldest 128 leave as a new 128 begin), and the warm-up
  batch, which never leaves: a full batch of the model's ``example`` input, timed when the
  worker starts, before it reads anything (built-in text models have one; a batch function
  may carry one as an attribute). A worker started again by ``batchline worker`` after its
  process died begins with the slowest call its predecessor timed.
- Before any call is timed (a model without an example, its first call) the bound is
  :data:`COLD_S`, the former fixed default: nothing is known of the model yet.

Why 10 times and 5 s: a healthy model's calls vary with their inputs and with the machine; 10x
the slowest recent call leaves room for a batch an order of magnitude slower than any seen
lately at the same work (a neighbour taking the CPU, a garbage collection, a first call with a
new shape), and longer inputs raise the bound with their work, so a model whose batches grow
longer never trips it (each call raises the bound for the next). 5 s keeps a fast model's
bound above the stalls of a busy machine. A model whose calls may take far longer than its
recent ones at the same work (a remote model server that stalls, a compile on a new shape)
should set ``max_batch_ms`` itself.

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
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, Protocol

from batchline.tracing import flush as flush_spans
from batchline.worker.metrics import Metrics
from batchline.worker.models import CountsPadding, Model, Prepared

__all__ = [
    "AUTO",
    "COLD_S",
    "FACTOR",
    "FLOOR_S",
    "HUNG_EXIT_CODE",
    "CallBound",
    "CallWatch",
    "Stamp",
    "Timing",
    "Watchdog",
    "Watched",
    "prime",
    "read_timing",
    "warm_up",
    "work_of",
    "write_timing",
]

logger = logging.getLogger(__name__)

#: Exit status of a worker process that ended itself because its model hung.
HUNG_EXIT_CODE = 70
#: ``max_batch_ms`` derived from the model's own call times.
AUTO = "auto"
#: The derived bound: this many times the slowest recent call ...
FACTOR = 10.0
#: ... and never less than this.
FLOOR_S = 5.0
#: The derived bound before any call was timed.
COLD_S = 60.0
#: A call slower than this share of its bound is slow: the worker hands its read-ahead back.
SLOW_SHARE = 0.25
_BUCKETS = 8  # the recent calls, in buckets of _BUCKET_CALLS: the oldest bucket leaves whole
_BUCKET_CALLS = 128
_TICK_S = 0.25
#: How long the watchdog waits for the event loop to take a hung call over.
_LOOP_GRACE_S = 1.0
_REMEMBER_EVERY_S = 1.0

#: One model call timed: seconds, and its work (None: unknown, as for a generation step).
Timing = tuple[float, float | None]
#: The model call running: its monotonic start, and its work.
Stamp = tuple[float, float | None]


class CallBound:
    """How long one model call may run: fixed, or derived from the calls timed so far.

    Calls are timed on the model's thread (one at a time: the worker's model calls never
    overlap); the watchdog reads the bound from its own thread. See the module docstring.

    Args:
        max_batch_ms: the setting: ``"auto"``, or milliseconds (0: no bound).
    """

    def __init__(self, max_batch_ms: int | Literal["auto"]) -> None:
        self.auto = max_batch_ms == AUTO
        self.fixed_s = 0.0 if max_batch_ms == AUTO else int(max_batch_ms) / 1e3
        self._warm_up: Timing | None = None
        # The slowest call of each bucket; the current bucket is _buckets[_index].
        self._buckets: list[Timing | None] = [None] * _BUCKETS
        self._index = 0
        self._calls = 0

    def observe(self, seconds: float, work: float | None = None) -> None:
        """A model call took ``seconds`` for ``work``."""
        i = self._index
        slowest = self._buckets[i]
        if slowest is None or seconds > slowest[0]:
            self._buckets[i] = (seconds, work)
        self._calls += 1
        if self._calls >= _BUCKET_CALLS:
            self._calls = 0
            self._index = i = (i + 1) % _BUCKETS
            self._buckets[i] = None  # the oldest leave

    def warmed_up(self, seconds: float, work: float | None) -> None:
        """The warm-up batch took ``seconds`` for ``work``: it stays among the recent calls."""
        self._warm_up = (seconds, work)

    def slowest(self) -> Timing | None:
        """The slowest recent call (the warm-up batch included), or None before any."""
        seen = [t for t in (self._warm_up, *self._buckets) if t is not None]
        return max(seen, key=lambda t: t[0]) if seen else None

    def expected_s(self, work: float | None = None) -> float | None:
        """The slowest recent call's time, each scaled up to ``work`` where it had less;
        None before any call was timed."""
        seen = [t for t in (self._warm_up, *self._buckets) if t is not None]
        if not seen:
            return None
        return max(_scaled(seconds, had, work) for seconds, had in seen)

    def limit_s(self, work: float | None = None) -> float:
        """How long a call of ``work`` may run (0: no bound); ``work`` None: a call no larger
        than the recent ones."""
        if not self.auto:
            return self.fixed_s
        expected = self.expected_s(work)
        if expected is None:
            return COLD_S
        return max(FLOOR_S, FACTOR * expected)

    def describe(self, limit_s: float) -> str:
        """The setting and the bound it gives, for a log line: ``1500`` or ``auto (5000 ms)``."""
        if not self.auto:
            return str(round(self.fixed_s * 1e3))
        return f"auto ({limit_s * 1e3:.0f} ms)"


def _scaled(seconds: float, had: float | None, work: float | None) -> float:
    if work is None or not had or work <= had:
        return seconds
    return seconds * work / had


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
    """

    def __init__(self, calls: Watched, *, worker_id: str, metrics: Metrics) -> None:
        self.bound = calls.bound
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
        if not bound.auto and bound.fixed_s <= 0:
            return done
        tick_s = _TICK_S if bound.auto else min(_TICK_S, bound.fixed_s / 4)

        def post(callback: Callable[[], None]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to do
                loop.call_soon_threadsafe(callback)

        def watch() -> None:
            calls = CallWatch(bound, tick_s=tick_s)
            follow = _Follow(bound, self._worker_id, self._metrics, self._calls.remember)
            while not done.wait(tick_s):  # a watchdog timer
                call = self._calls.running
                state = calls.tick(time.monotonic(), call)
                follow.step()
                if state == "slow" and call is not None:
                    post(functools.partial(on_slow, call))
                elif state == "hung":
                    self._trip(calls, post, on_hung, exit_if_loop_blocked)
                    return

        threading.Thread(target=watch, name="batchline-watchdog", daemon=True).start()
        return done

    def _trip(
        self,
        calls: CallWatch,
        post: Callable[[Callable[[], None]], None],
        on_hung: Callable[[], None],
        exit_if_loop_blocked: bool,
    ) -> None:
        logger.error(
            "worker %s: a model call has run %.1f s, past max_batch_ms=%s: handing back what "
            "it holds and stopping",
            self._worker_id,
            calls.ran_s,
            self.bound.describe(calls.limit_s),
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


# -- what the worker measures --------------------------------------------------------------------


def work_of(batch: Sequence[Prepared], *, pads: bool) -> float:
    """A batch's work: its padded tokens for a model that pads, its items' lengths summed
    for one that does not."""
    if not batch:
        return 0.0
    if pads:
        return float(len(batch) * max(p.length for p in batch))
    return float(sum(p.length for p in batch))


def warm_up(
    model: Model,
    *,
    batch_size: int,
    pads: bool,
    padding: Callable[[int, int], None] | None = None,
) -> Timing | None:
    """Time one full batch of the model's ``example`` input (None: it has none, or the batch
    failed, which is logged). Its outputs are dropped; a model that reports its padding
    reports none of this batch's, and ``padding`` is its sink again afterwards."""
    example = getattr(model, "example", None)
    if example is None:
        return None
    padded = model if isinstance(model, CountsPadding) else None
    try:
        items = model.preprocess(example)
        batch = (items * batch_size)[:batch_size]
        if not batch:
            return None
        if padded is not None:
            padded.count_padding(_ignore)
        started = time.perf_counter()
        try:
            model.infer([p.payload for p in batch])
        finally:
            if padded is not None and padding is not None:
                padded.count_padding(padding)
        took = time.perf_counter() - started
    except Exception as exc:
        logger.warning("the warm-up batch failed (%s: %s)", type(exc).__name__, exc)
        return None
    return took, work_of(batch, pads=pads)


def prime(
    bound: CallBound,
    model: Model | None,
    *,
    batch_size: int,
    pads: bool,
    padding: Callable[[int, int], None] | None = None,
    before: Timing | None = None,
) -> str:
    """Give a derived bound its first timings before the worker serves: the warm-up batch
    of ``model`` (None: none, as for generation) and the slowest call the previous worker
    process timed (``before``). Returns how the bound stands, for the log."""
    if not bound.auto:
        return "fixed" if bound.fixed_s else "no bound"
    timing = (
        None if model is None else warm_up(model, batch_size=batch_size, pads=pads, padding=padding)
    )
    if timing is not None:
        bound.warmed_up(*timing)
    if before is not None:
        bound.observe(*before)
    slowest = bound.slowest()
    if slowest is None:
        return "no model call timed yet"
    whose = "the warm-up batch" if slowest == timing else "the previous worker process's"
    return f"slowest call timed {slowest[0] * 1e3:.1f} ms, {whose}"


def _ignore(_real: int, _padded: int) -> None:
    return None


def read_timing(path: Path) -> Timing | None:
    """The slowest call a previous worker process remembered in ``path`` (None: none)."""
    try:
        seconds, work = json.loads(path.read_text(encoding="utf-8"))
        return float(seconds), None if work is None else float(work)
    except (OSError, ValueError, TypeError):
        return None


def write_timing(path: Path, timing: Timing) -> None:
    """Remember the slowest recent call in ``path`` for the next worker process (whole, or
    not at all: written beside it and renamed)."""
    spare = path.with_name(path.name + ".new")
    with contextlib.suppress(OSError):
        spare.write_text(json.dumps(list(timing)), encoding="utf-8")
        os.replace(spare, path)
