"""A worker's model calls: how long one may run (``max_batch_ms``), each stamped and timed
into that bound, and what the worker does about one that runs long or hangs.

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

A coroutine model (an ``async def`` batch function: its ``infer`` returns an awaitable) is
called as a plain one is: on the batcher's thread, holding the model's lock, stamped and
timed, while its coroutine runs on the worker's event loop and the thread waits for its end
(:func:`finish`); its warm-up batch likewise. So its calls are bounded, and its hang handled,
exactly as a plain model's.

The guard. Every model call runs through :meth:`Guard.call`: stamped (the watchdog,
:mod:`batchline.worker.upkeep._watchdog`, reads the stamp from its thread) and timed into the
bound. When a call runs long (a quarter of its bound) the worker hands back the entries it
read ahead and has not started (:meth:`Guard.release`), and reads and reclaims nothing until
the call ends. When it hangs, the worker signs off (out of the workers' set: ``batchline
worker --check`` fails) and hands back everything it holds (:meth:`Guard.abandon`), at once,
from its event loop; while a hung call blocks that loop, from the watchdog's thread over a
connection of its own (:meth:`Guard.abandon_blocked`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from redis.asyncio import ConnectionPool, Redis

from batchline.config import WorkerSettings
from batchline.transport import (
    POOL_NO_CLIENT_INFO,
    RedisClient,
    as_client,
    connect,
    ignoring_redis_failures,
    single_node,
)
from batchline.worker.models import CountsPadding, Model, Prepared
from batchline.worker.shared._held import Claims, Meta
from batchline.worker.shared._turns import Turns

__all__ = [
    "AUTO",
    "COLD_S",
    "FACTOR",
    "FLOOR_S",
    "CallBound",
    "Guard",
    "Stamp",
    "Timing",
    "finish",
    "prime",
    "read_timing",
    "warm_up",
    "work_of",
    "write_timing",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: ``max_batch_ms`` derived from the model's own call times.
AUTO = "auto"
#: The derived bound: this many times the slowest recent call ...
FACTOR = 10.0
#: ... and never less than this.
FLOOR_S = 5.0
#: The derived bound before any call was timed.
COLD_S = 60.0
_BUCKETS = 8  # the recent calls, in buckets of _BUCKET_CALLS: the oldest bucket leaves whole
_BUCKET_CALLS = 128

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


class Guard:
    """The worker's model calls, for its watchdog.

    Args:
        settings: the worker's settings (``max_batch_ms``, ``claim_idle_ms``, ...).
        claims: what the worker holds.
        workers_key: the workers' set, which the worker leaves when it hangs.
        redis: the worker's client; ``own``: made from ``settings`` (the watchdog's thread
            then makes another the same way; else it copies the client's pool).

    Attributes:
        bound_file: where the previous worker process left its slowest call, and this one
            leaves its own (None: nowhere; the worker sets it from ``Worker.bound_file`` as
            it starts).
    """

    def __init__(
        self,
        settings: WorkerSettings,
        claims: Claims,
        *,
        workers_key: str,
        redis: RedisClient,
        own: bool,
    ) -> None:
        self.bound = CallBound(settings.max_batch_ms)
        self.running: Stamp | None = None  # the model call running
        #: Set (by the watchdog) once a model call ran past its bound.
        self.hung = threading.Event()
        self._slow: Stamp | None = None  # the call whose read-ahead was handed back
        self._settings = settings
        self._claims = claims
        self._workers_key = workers_key
        self._redis = redis
        self._own = own
        self.bound_file: Path | None = None
        #: Shared with the other queues of one process (``serve``): their calls take turns.
        self.turns: Turns | None = None
        #: The stamp of the model's load running (None between loads), for a model loaded
        #: by demand (None: no such model): the watchdog bounds it by ``max_load_s``.
        self.load_stamp: Callable[[], Stamp | None] | None = None
        #: Set (on the loop) while the model, loaded by demand, cannot load: its last load
        #: failed and none has succeeded since. The worker reads and reclaims nothing
        #: meanwhile, and is out of the workers' set (unhealthy).
        self.load_failing = asyncio.Event()
        #: The worker's event loop, where a coroutine model's calls run (set as it runs).
        self.loop: asyncio.AbstractEventLoop | None = None
        #: Told once the model's calls may not run on the event loop's own thread (a
        #: coroutine model, whose call waits for that loop; calls taking turns): the
        #: executors' batchers then keep them on their threads.
        self.off_loop: list[Callable[[], None]] = []
        self._kept_off_loop = False

    @property
    def slow(self) -> bool:
        """A call runs long (its read-ahead was handed back): read and reclaim nothing."""
        running = self.running
        return running is not None and running is self._slow

    def take_turns(self, turns: Turns) -> None:
        """Run each model call in its turn among the other queues' of the process: never on
        the event loop's own thread, which another queue's turn may need meanwhile."""
        self.turns = turns
        self._keep_off_loop()

    def infer(self, model: Model, payloads: list[Any]) -> Any:
        """``model.infer(payloads)`` to its end (:func:`finish`), on the caller's thread."""
        outputs = model.infer(payloads)
        if inspect.isawaitable(outputs):
            self._keep_off_loop()
        return finish(outputs, self.loop)

    def _keep_off_loop(self) -> None:
        if not self._kept_off_loop:
            self._kept_off_loop = True
            for keep in self.off_loop:
                keep()

    def call(self, fn: Callable[[], T], work: float | None = None) -> T:
        """``fn()``, one model call of ``work`` (model calls are serialised by the batchers'
        lock, so one stamp tells the watchdog), timed into the bound; in its turn, where
        the process serves other queues (the wait for it is not the call's time)."""
        if self.turns is None:
            return self._call(fn, work)
        with self.turns.turn():
            return self._call(fn, work)

    def _call(self, fn: Callable[[], T], work: float | None) -> T:
        self.running = stamp = (time.monotonic(), work)
        try:
            return fn()
        finally:
            self.running = None
            self.bound.observe(time.monotonic() - stamp[0], work)

    def measure(
        self,
        model: Model | None,
        *,
        pads: bool,
        padding: Callable[[int, int], None] | None,
    ) -> None:
        """Before serving (on a thread): the bound's first timings (:func:`prime`:
        ``model``'s warm-up batch, None for none), logged."""
        bound_file = self.bound_file
        s = self._settings
        how = prime(
            self.bound,
            model,
            batch_size=s.batch_size,
            pads=pads,
            padding=padding,
            before=None if bound_file is None else read_timing(bound_file),
            loop=self.loop,
        )
        limit_ms = self.bound.limit_s() * 1e3
        logger.info(
            "worker %s: max_batch_ms=%s: %.0f ms (%s)",
            self._claims.worker_id,
            s.max_batch_ms,
            limit_ms,
            how,
        )

    def remember(self, timing: Timing) -> None:
        """The slowest recent call, for the next worker process (from the watchdog)."""
        bound_file = self.bound_file
        if bound_file is not None:
            write_timing(bound_file, timing)

    def release(self, stamp: Stamp) -> asyncio.Future[None] | None:
        """The call ``stamp`` runs long (on the loop, from the watchdog): hand back the
        entries held and not started, so that other workers serve them; from now until it
        ends, :attr:`slow`. Returns the hand-back under way."""
        if stamp is not self.running:
            return None  # it ended meanwhile
        self._slow = stamp
        metas = self._claims.forget(started=False)
        if not metas:
            return None
        logger.warning(
            "worker %s: a model call is running long (%.1f s): handing back %d requests it "
            "read ahead",
            self._claims.worker_id,
            time.monotonic() - stamp[0],
            len(metas),
        )
        return asyncio.ensure_future(
            self._claims.hand_back(metas, idle_ms=self._settings.claim_idle_ms)
        )

    async def abandon(self) -> None:
        """Hung: sign off and hand back every entry held (on the loop)."""
        metas = self._claims.forget(started=True)
        with ignoring_redis_failures():
            await self._sign_off(self._redis)
        await self._claims.hand_back(metas, idle_ms=self._settings.claim_idle_ms)

    async def cannot_load(self, metas: list[Meta]) -> None:
        """The model, loaded by demand, did not load for these requests (on the loop): they
        go back unanswered, their delivery counts as they were (idle past
        ``claim_idle_ms``: another worker takes them at once); the worker signs off and is
        :attr:`load_failing` until a load succeeds."""
        if not self.load_failing.is_set():
            self.load_failing.set()
            logger.error(
                "worker %s: its model did not load: handing back what needs it, reading "
                "nothing and reporting unhealthy until a load succeeds",
                self._claims.worker_id,
            )
            with ignoring_redis_failures():
                await self._sign_off(self._redis)
        await self._claims.hand_back(metas, idle_ms=self._settings.claim_idle_ms)

    def abandon_blocked(self) -> None:
        """:meth:`abandon` from the watchdog's thread while the hung call blocks the loop."""
        client: RedisClient | None = None
        plain = single_node(self._redis)
        if self._own:
            client = connect(self._settings)
        elif plain is not None:  # the caller's client: a copy of its pool
            pool = plain.connection_pool
            kwargs = pool.connection_kwargs
            client = as_client(
                Redis(
                    connection_pool=ConnectionPool(
                        connection_class=pool.connection_class, **kwargs, **POOL_NO_CLIENT_INFO
                    )
                )
            )
        if client is None:
            logger.warning("no client to hand back with: what it holds waits claim_idle_ms")
            return
        self._claims.hand_back_blocked(
            client, idle_ms=self._settings.claim_idle_ms, sign_off=self._sign_off
        )

    def _sign_off(self, client: RedisClient) -> Any:
        return client.zrem(self._workers_key, self._claims.worker_id)


# -- what the worker measures ----------------------------------------------------------------------


def work_of(batch: Sequence[Prepared], *, pads: bool) -> float:
    """A batch's work: its padded tokens for a model that pads, its items' lengths summed
    for one that does not."""
    if not batch:
        return 0.0
    if pads:
        return float(len(batch) * max(p.length for p in batch))
    return float(sum(p.length for p in batch))


def finish(outputs: Any, loop: asyncio.AbstractEventLoop | None) -> Any:
    """A model call's outputs: ``outputs`` as they are, or, a coroutine model's (an
    awaitable), what it returns once run to its end on ``loop``, the worker's event loop,
    while this thread waits for it, as it waits for a plain model's call. Never on ``loop``'s
    own thread, which the wait would block for good (RuntimeError)."""
    if not inspect.isawaitable(outputs):
        return outputs
    coroutine = outputs if asyncio.iscoroutine(outputs) else _awaited(outputs)
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    try:
        if loop is None or running is loop:
            where = "no event loop" if loop is None else "on its own event loop's thread"
            raise RuntimeError(f"a coroutine model's call cannot run {where}")
        future = asyncio.run_coroutine_threadsafe(coroutine, loop)  # RuntimeError: closed
    except RuntimeError:
        coroutine.close()  # never to run: no warning that it was never awaited
        raise
    return future.result()


async def _awaited(outputs: Any) -> Any:
    return await outputs


def warm_up(
    model: Model,
    *,
    batch_size: int,
    pads: bool,
    padding: Callable[[int, int], None] | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
) -> Timing | None:
    """Time one full batch of the model's ``example`` input (None: it has none, or the batch
    failed, which is logged). Its outputs are dropped; a model that reports its padding
    reports none of this batch's, and ``padding`` is its sink again afterwards. A coroutine
    model's batch runs to its end on ``loop`` (:func:`finish`): the time is its call's."""
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
            finish(model.infer([p.payload for p in batch]), loop)
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
    loop: asyncio.AbstractEventLoop | None = None,
) -> str:
    """Give a derived bound its first timings before the worker serves: the warm-up batch
    of ``model`` (None: none, as for generation; a coroutine model's runs on ``loop``) and
    the slowest call the previous worker process timed (``before``). Returns how the bound
    stands, for the log."""
    if not bound.auto:
        return "fixed" if bound.fixed_s else "no bound"
    timing = (
        None
        if model is None
        else warm_up(model, batch_size=batch_size, pads=pads, padding=padding, loop=loop)
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
