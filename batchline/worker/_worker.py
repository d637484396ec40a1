"""The worker: read requests from Redis, batch them with the core, run the model, answer.

:func:`~batchline.worker._assembly.assemble` builds its parts once; the :class:`Worker` runs
them (tasks on one event loop, so that Redis I/O and decoding overlap the model's compute,
which runs on the batcher's own thread, or on the loop for a model quick enough, see
:class:`~batchline.core.pace.Pace`) and stops them:

- the *serving path* (:mod:`.serving`, in the order a request passes): the admitter moves
  what producers enqueued into the work streams; the *reader* (:mod:`.serving._reader`) fills
  the batch policy from ``XREADGROUP`` (all priority streams, highest first), keeping at most
  ``read_ahead`` batches ahead of the model; :class:`~.serving._serving.Serving` owns each
  request's way from there: decoding and tokenizing (:class:`.serving._intake.Preparer`, on
  ``prep_threads`` threads of their own for tokenizer-backed models), the *executor* (the
  asyncio driver of the in-process core, same policy, isolation and padding; for
  ``--model generate`` continuous batching, :mod:`.serving._generation_executor`), and the
  answers, which the *writer* (:mod:`.serving._writer`) coalesces into one call of the
  completion script per write (it acknowledges each entry and, only if the acknowledgement
  took, writes its result with its TTL and pushes the replies, then deletes the entries);
- the *cancel follower* reads the queue's cancel stream (:mod:`batchline.transport._cancels`);
- the *upkeep* (:mod:`.upkeep`): the *janitor* keeps this worker's claims
  (:mod:`.shared._held`) alive during long batches, the *reclaimer* takes over entries that
  dead workers left pending (XAUTOCLAIM), dead-lettering those delivered too often, the
  *watchdog* bounds one model call, and the *heartbeat* publishes liveness and statistics.

Containment (a poison input, a hung model call): see :mod:`.upkeep._upkeep` and
:mod:`.shared._guard`.

SIGTERM or SIGINT (or :meth:`Worker.stop`) drains: stop reading, run what was read, write,
exit; :attr:`Worker.stop_signal` says which signal it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchline.config import WorkerSettings, redact_url
from batchline.config._environment import given_or_read
from batchline.errors import WorkerHung
from batchline.keys import check_name, new_worker_id
from batchline.tracing import flush as flush_spans
from batchline.transport import RedisArgument, ignoring_redis_failures, load_library, wait_for_redis
from batchline.worker._assembly import assemble
from batchline.worker._cpu_threads import apply_threads, available_cpus, prepare_environment
from batchline.worker._ready import ready_line
from batchline.worker.metrics import Metrics
from batchline.worker.models import Model, load
from batchline.worker.models._lazy import LazyModel, ModelPool
from batchline.worker.models._weights import weight_bytes
from batchline.worker.serving._executors import pads
from batchline.worker.shared._consumers import ensure_groups
from batchline.worker.shared._turns import Turns
from batchline.worker.upkeep._upkeep import every

__all__ = ["Worker"]

logger = logging.getLogger(__name__)


#: How long a hung worker waits for its reader's current read before it cuts it off.
_READER_GRACE_S = 3.0
#: The longest pause between two loads of a model (loaded by demand) that failed to load.
_LOAD_AGAIN_MAX_S = 60.0


class Worker:
    """Serve one queue: ``await Worker(...).run()`` until SIGTERM or :meth:`stop`.

    Args:
        settings: the worker's settings; default: ``BATCHLINE_*`` variables and
            ``overrides`` (an unknown ``BATCHLINE_*`` variable is an error).
        model: a :class:`~batchline.worker.models.Model` to serve, or a model spec (the
            ``model`` setting, a single setting).
        redis: an asyncio Redis client instead of one made from ``redis_url``.
        pool: the memory budget it shares with other workers of the process, for a model
            loaded by demand or unloaded when idle (``serve``).
        **overrides: single settings, e.g. ``batch_size=64`` (not with ``settings``:
            TypeError).
    """

    def __init__(
        self,
        settings: WorkerSettings | None = None,
        *,
        model: Model | str | None = None,
        redis: RedisArgument | None = None,
        pool: ModelPool | None = None,
        **overrides: Any,
    ) -> None:
        if isinstance(model, str):  # the setting (a model spec), not a model object
            overrides["model"], model = model, None
        self.settings = s = given_or_read(WorkerSettings, settings, overrides)
        self.keys = s.keys
        self.worker_id = check_name("worker_id", s.worker_id or new_worker_id())
        self.threads = s.threads or available_cpus()
        self._parts = parts = assemble(
            s, model, worker_id=self.worker_id, threads=self.threads, redis=redis, pool=pool
        )
        self._pool = pool
        self.model: Model = parts.model
        #: Its answers by status (and ``reclaimed``), as its statistics count them.
        self.counts: Counter[str] = parts.counts
        self.metrics: Metrics = parts.metrics
        self._loop: asyncio.AbstractEventLoop | None = None
        # Set while its loops run: cleared as it closes (the loops check it, besides being
        # cancelled).
        self._running = asyncio.Event()
        self._admits = False  # whether the queue's functions are loaded (Redis >= 7)
        self.ready = threading.Event()
        #: Held while its model loads (shared by the queues of one process: ``serve``).
        self.loading = asyncio.Lock()
        #: The signal (SIGTERM, SIGINT) that stopped the worker, if one did.
        self.stop_signal: int | None = None
        self._hand_back: asyncio.Event | None = None  # set: stop handing back, not draining
        self._stop_asked = False  # stop() was called (before run() had a loop, maybe)
        self._ran = False  # run() was called: a worker runs once

    #: End the process if a hung model call blocks the event loop (``batchline worker``).
    exit_if_loop_blocked = False
    #: Whether :meth:`run` handles SIGTERM and SIGINT (a group of workers handles them for
    #: all of its workers instead).
    handles_signals = True
    #: Where the slowest recent model call is remembered for the next worker process
    #: (``batchline worker``'s supervisor): ``max_batch_ms`` auto starts from it.
    bound_file: Path | None = None

    def __repr__(self) -> str:
        return f"<Worker {self.worker_id} queue={self.keys.queue!r}>"

    async def _unload_if_idle(self) -> None:
        model = self.model
        if isinstance(model, LazyModel) and model.loaded:  # off the loop: it collects garbage
            await asyncio.get_running_loop().run_in_executor(None, model.unload_if_idle)

    def take_turns(self, turns: Turns) -> None:
        """Run each model call in its turn among the other queues' of the process."""
        self._parts.guard.take_turns(turns)

    def stats(self) -> dict[str, Any]:
        """This worker's statistics, as published with its heartbeat."""
        return self._parts.upkeep.stats()

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Load the model, serve until stopped, then drain and return. A worker runs once
        (RuntimeError the second time): to serve again, make a new one."""
        if self._ran:
            raise RuntimeError(
                f"worker {self.worker_id} has run already: a Worker runs once (make a new one)"
            )
        self._ran = True
        loop = self._loop = asyncio.get_running_loop()
        p = self._parts
        p.guard.bound_file = self.bound_file
        p.guard.loop = loop  # where a coroutine model's calls run
        hung = self._hand_back = asyncio.Event()
        if self._stop_asked:  # stop() came before the loop: it stops now, before it starts
            p.serving.stop()
        # From the start: a signal while it waits for Redis or loads its model stops it too
        # (and a second one, Ctrl-C reaching it twice, changes nothing).
        self._install_signals(loop)
        if not await self._started(loop):
            return
        tasks = self._start_tasks(loop)
        reader = tasks[0]

        def on_hung() -> None:  # on the loop, from the watchdog
            hung.set()
            self.stop()

        watchdog = p.upkeep.watchdog.start(
            loop,
            on_slow=p.upkeep.on_slow,
            on_hung=on_hung,
            exit_if_loop_blocked=self.exit_if_loop_blocked,
        )
        self.ready.set()
        generation = p.generation is not None
        logger.info(
            "%s", ready_line(self.model, p.model_name, self.settings, generation=generation)
        )
        stopped = loop.create_task(p.serving.stopped.wait())
        crashed: list[BaseException] = []
        try:
            done, _ = await asyncio.wait({stopped, *tasks}, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stopped}:
                if not task.cancelled() and task.exception() is not None:
                    crashed.append(task.exception())  # type: ignore[arg-type]
                    logger.error(
                        "worker %s: %s failed",
                        self.worker_id,
                        task.get_name(),
                        exc_info=task.exception(),
                    )
            self.stop()  # drain: what was read is still answered
            await self._drain_or_abandon(reader, hung)
        finally:
            stopped.cancel()
            watchdog.set()
            await self._close(tasks)
        if p.guard.hung.is_set():
            raise WorkerHung(
                f"worker {self.worker_id}: a model call or load ran past its bound "
                f"(max_batch_ms={self.settings.max_batch_ms}, "
                f"max_load_s={self.settings.max_load_s:g})"
            )
        if crashed:
            # Exit non-zero so that a supervisor restarts the worker.
            raise RuntimeError(f"worker {self.worker_id} stopped: a task failed") from crashed[0]

    async def _started(self, loop: asyncio.AbstractEventLoop) -> bool:
        """:meth:`_start`, unless :meth:`stop` comes first (False: it closed what it opened;
        a model still loading on its thread finishes there)."""
        starting = loop.create_task(self._start(loop), name="batchline-start")
        stopped = loop.create_task(self._parts.serving.stopped.wait())
        try:
            await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if self._pool is not None:  # the process's loads by demand wait no more for it
                self._pool.started(self)
        if starting.done():
            starting.result()  # what it raised (Redis unreachable, a model that fails)
            return True
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await self._release()
        return False

    async def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Reach Redis, load the model, create the groups, catch up on cancels."""
        p, s = self._parts, self.settings
        logger.info(
            "worker %s: queue %r on %s, model %s, event loop %s",
            self.worker_id,
            self.keys.queue,
            redact_url(s.redis_url.get_secret_value()),
            p.model_name,
            type(loop).__module__.split(".")[0],
        )
        await wait_for_redis(p.redis, s, wait_s=s.redis_wait_s)
        async with self.loading:  # one model at a time loads in a process (imports race)
            if p.serving.stopped.is_set():
                # A stop came, and its cancellation was lost in the Redis client's wait (Python
                # 3.11): no load begins, which nothing would wait for.
                return
            began = time.perf_counter()
            prepare_environment(self.threads)  # before the model loads torch (or anything)
            loading = functools.partial(
                load, self.model, spec=p.model_name, path=s.model_path, device=s.device
            )
            await self._bounded_load(_on_a_thread(loop, loading), began)
            apply_threads(self.threads)
            # The warm-up batch of a model loaded now (one loaded by demand has not; a lazy
            # one loaded at start, to be unloaded when idle, has).
            model = self.model
            warm = p.generation is None and (not isinstance(model, LazyModel) or model.loaded)
            measure = functools.partial(
                p.guard.measure,
                self.model if warm else None,
                pads=pads(self.model),
                padding=getattr(p.executors.main, "record_padding", None),
            )
            # Its warm-up batch within the same bound, off the loop's executor (which the
            # loop's end would wait for, were that batch to hang).
            await self._bounded_load(_on_a_thread(loop, measure), began)
            took = time.perf_counter() - began
        if isinstance(self.model, LazyModel):  # its loads report themselves from now on
            self.model.on_load = self.metrics.model_loaded
            self.model.on_unload = self.metrics.model_unloaded
            if self.model.loaded:
                self.metrics.model_loaded(self.model.load_s or took, self.model.weights)
        else:
            size = weight_bytes(self.model)
            self.metrics.model_loaded(took, size)
            shown = "" if size is None else f", {size / 2**20:,.1f} MiB of weights"
            logger.info("worker %s: model loaded in %.1f s%s", self.worker_id, took, shown)
        p.prep.start()
        await ensure_groups(p.redis, self.keys.streams_low_first)
        self._admits = await load_library(p.redis, self.keys)
        await p.cache.publish(p.redis)
        p.facts.load(self.model)
        await p.facts.publish(p.redis)
        if p.warm_first is not None:  # before the first read: whether to leave it to others
            await p.warm_first.step(p.redis)
        if self._admits:  # what waits, before the first read: highest priority read first
            await p.admitter.admit_all()
        await p.cancels.catch_up(p.redis, self.keys)
        self.metrics.start()

    async def _bounded_load(self, loading: asyncio.Future[None], began: float) -> None:
        """Await the model's start load (or its warm-up batch), within ``max_load_s`` (0: no
        bound) of ``began`` (``time.perf_counter()``): past it the worker is hung, as for a
        load by demand (WorkerHung: ``batchline worker`` exits with the hung status for its
        supervisor; the worker holds nothing yet, and its load's thread cannot be stopped
        otherwise: it is a daemon thread, not the loop's executor, which the event loop's
        end would wait for)."""
        bound = self.settings.max_load_s
        left = max(0.0, bound - (time.perf_counter() - began))
        try:
            await asyncio.wait({loading}, timeout=left if bound > 0 else None)
        finally:
            if not loading.done():  # past the bound, or a stop came: nobody waits for it
                loading.cancel()
        if not loading.cancelled():
            loading.result()  # what the load raised (its own TimeoutError included)
            return
        logger.error(
            "worker %s: the model's load has run %.1f s, past max_load_s=%g, before the "
            "worker served anything: stopping",
            self.worker_id,
            bound,
            bound,
        )
        raise WorkerHung(f"worker {self.worker_id}: the model's load ran past max_load_s={bound:g}")

    def _start_tasks(self, loop: asyncio.AbstractEventLoop) -> list[asyncio.Task[None]]:
        """The reader (first) and the upkeep tasks."""
        p, s = self._parts, self.settings
        running = self._running
        running.set()

        def closing() -> bool:
            return not running.is_set()

        jobs = {
            "reader": p.reader.run(p.space, p.serving.stopped),
            "writer": p.answers.watch(),
            **p.upkeep.jobs(closing),
            "cancels": p.cancels.follow(p.redis, self.keys, running.is_set),
            "cancel-trim": every(s.claim_idle_ms / 3e3, "cancel trim", p.cancel_trim.step, closing),
            "cache": every(
                s.heartbeat_s, "cache", lambda: p.cache.beat(p.redis, self.metrics), closing
            ),
            "facts": every(s.heartbeat_s, "facts", lambda: p.facts.publish(p.redis), closing),
        }
        if p.warm_first is not None:
            warm = p.warm_first
            jobs["warm-first"] = every(
                s.heartbeat_s, "warm first", lambda: warm.step(p.redis), closing
            )
        if isinstance(self.model, LazyModel) and self.model.idle_s is not None:
            jobs["unload"] = every(
                min(self.model.idle_s / 4, 1.0), "unload", self._unload_if_idle, closing
            )
        if isinstance(self.model, LazyModel):
            jobs["load-again"] = self._load_again(self.model, loop, closing)
        if self._admits:
            jobs["admitter"] = p.admitter.run(running.is_set)
            jobs["admitter-wakes"] = p.admitter.run_wakes(running.is_set)
        return [loop.create_task(job, name=f"batchline-{name}") for name, job in jobs.items()]

    async def _load_again(
        self, model: LazyModel, loop: asyncio.AbstractEventLoop, closing: Callable[[], bool]
    ) -> None:
        """While the model, loaded by demand, cannot load (a request's load failed: the
        worker reads nothing and is unhealthy): try the load again on a thread of its own,
        after a back-off from ``heartbeat_s`` doubling to :data:`_LOAD_AGAIN_MAX_S`; once
        it loads, the worker is healthy and reads again."""
        p = self._parts
        failing = p.guard.load_failing
        pause_s = self.settings.heartbeat_s
        while not closing():
            await failing.wait()
            await asyncio.sleep(pause_s)  # a back-off, not a poll for work
            try:
                await _on_a_thread(loop, model.ensure)
            except Exception:  # logged by the model
                pause_s = min(2 * pause_s, _LOAD_AGAIN_MAX_S)
                continue
            pause_s = self.settings.heartbeat_s
            failing.clear()
            self.metrics.healthy()
            p.space.set()  # the reader: room again
            logger.info("worker %s: its model loaded: serving again", self.worker_id)

    async def _close(self, tasks: list[asyncio.Task[None]]) -> None:
        # Cancelling alone is not enough on Python 3.11: a cancellation that lands just as
        # redis-py's internal wait_for completes is swallowed, so the loops also end on this.
        p = self._parts
        self._running.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *p.upkeep.handing_back, return_exceptions=True)
        with ignoring_redis_failures():
            await p.redis.zrem(self.keys.workers, self.worker_id)
        await self._release()
        answered = ", ".join(f"{n} {status}" for status, n in sorted(self.counts.items()) if n)
        logger.info("worker %s: stopped (answered %s)", self.worker_id, answered or "nothing")
        if p.trace is not None:
            await asyncio.get_running_loop().run_in_executor(None, flush_spans)

    async def _release(self) -> None:
        """Stop the preparing threads and the metrics; close the connections it made."""
        self._parts.prep.close()
        self.metrics.stop()
        for client in self._parts.owned_clients():
            await client.aclose()

    async def _drain_or_abandon(self, reader: asyncio.Task[None], hung: asyncio.Event) -> None:
        """Drain (run what was read, write its answers); if the model hangs, before or
        during the drain, hand back what is held instead."""
        p = self._parts
        drain = asyncio.ensure_future(self._drain(reader))
        hang = asyncio.ensure_future(hung.wait())
        await asyncio.wait({drain, hang}, return_when=asyncio.FIRST_COMPLETED)
        hang.cancel()
        if drain.done():
            drain.result()
            return
        await p.guard.abandon()  # at once: not after the drain, nor after the next read
        drain.cancel()
        await asyncio.gather(drain, return_exceptions=True)
        cut_off = False
        if not reader.done():
            # It returns after its current read (at most one block interval), unless the
            # preparing of what it read hangs (a load past max_load_s): then it is cut off
            # (what it read is held, and handed back below).
            done, _ = await asyncio.wait({reader}, timeout=_READER_GRACE_S)
            cut_off = not done
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        await p.guard.abandon()  # what that read brought in
        await p.answers.drain()  # the answers already computed
        if cut_off:  # what is held now never became a call: back with its delivery count
            taken = p.claims.take_unstarted()
            await p.claims.give_back(taken, idle_ms=self.settings.claim_idle_ms)
        # Nothing is answered from here on: abandon() forgot every call held.
        await p.executors.main.aclose(drain=False)
        await p.executors.alone.aclose(drain=False)

    async def _drain(self, reader: asyncio.Task[None]) -> None:
        p = self._parts
        if not reader.done():
            # Shielded: cancelling the drain (the model hung) must not cut a read short,
            # whose entries would then be this worker's without its knowing.
            await asyncio.shield(reader)  # returns after its current read (one block interval)
        await p.executors.alone.aclose(drain=True)
        await p.executors.main.aclose(drain=True)
        await p.chunks.drain()
        await p.answers.drain()

    def hand_back(self) -> None:
        """Stop without answering what it holds: hand it back to the queue (its delivery
        counts as they are), as a hung worker does; on the worker's loop. For a worker beside
        one that hung in the same process (``serve``): that process ends at once."""
        if self._hand_back is not None:
            self._hand_back.set()
        self.stop()

    def stop(self) -> None:
        """Drain and stop; callable from any thread and from signal handlers, and before
        :meth:`run` starts (it then returns at once)."""
        self._stop_asked = True  # before the loop is read: run() sets the loop, then reads it
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if _running_loop() is loop:
            self._parts.serving.stop()
        else:
            loop.call_soon_threadsafe(self.stop)

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.handles_signals:
            install_signals(loop, self._on_signal)

    def _on_signal(self, sig: int) -> None:
        if self.stop_signal is None:
            logger.info(
                "worker %s: %s: %s",
                self.worker_id,
                signal.Signals(sig).name,
                "draining (no more reads; what was read is answered)"
                if self.ready.is_set()
                else "stopping before it served",
            )
        self.stop_signal = sig
        self.stop()


def install_signals(loop: asyncio.AbstractEventLoop, handler: Callable[[int], None]) -> None:
    """``handler(signal)`` on SIGTERM and SIGINT, on ``loop`` (from the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, handler, sig)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


#: The name of the thread a model's start load runs on.
LOAD_THREAD = "batchline-load"


def _on_a_thread(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> asyncio.Future[None]:
    """Run ``fn`` on a daemon thread of its own; a future of ``loop`` for its end (its
    exception, if it raised; nothing is set once the future is cancelled or the loop closed)."""
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if done.done():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            fn()
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name=LOAD_THREAD, daemon=True).start()
    return done


def loading_still() -> bool:
    """Whether a model's start load still runs on its thread (a stop came while it loaded,
    or it ran past ``max_load_s``): the process should end without finalizing, which a
    library's native code in the middle of a load may not survive."""
    return any(t.name == LOAD_THREAD and t.is_alive() for t in threading.enumerate())
