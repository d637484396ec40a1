"""The worker: read requests from Redis, batch them with the core, run the model, answer.

Tasks on one event loop, so that Redis I/O and decoding overlap the model's compute (which
runs on the batcher's own thread, or on the loop for a model quick enough, see
:class:`~batchline.core.pace.Pace`):

- the *reader* (:mod:`.serving._reader`) fills the batch policy from ``XREADGROUP`` (all priority
  streams, highest first), keeping at most ``read_ahead`` batches ahead of the model;
  decoding and tokenizing (:class:`.serving._intake.Preparer`) run on ``prep_threads`` threads of
  their own for tokenizer-backed models;
- the *model batcher* is the asyncio driver of the in-process core (same policy, same
  isolation, same padding): batch size, timeout, token budget, priorities, deadlines and
  length grouping all come from there;
  for ``--model generate`` an executor with the same small interface runs continuous
  batching instead (:mod:`.serving._generation_executor`); :mod:`.serving._executors`
  builds the one the model needs;
- the *writer* (:mod:`.serving._writer`) coalesces finished requests into one call of the
  completion script per write, which acknowledges each entry and, only if the
  acknowledgement took, writes its result (with its TTL) and pushes the replies, then
  deletes the entries;
- the *cancel follower* reads the queue's cancel stream (:mod:`batchline.transport._cancels`);
- the *janitor* keeps this worker's claims (:mod:`.shared._held`) alive during long batches, the
  *reclaimer* takes over entries that dead workers left pending (XAUTOCLAIM),
  dead-lettering those delivered too often, the *watchdog* bounds one model call, and the
  *heartbeat* publishes liveness and statistics: parts the worker owns (:mod:`.upkeep`).

Containment (a poison input, a hung model call): see :mod:`.upkeep._upkeep` and
:mod:`.upkeep._watchdog`.

SIGTERM or SIGINT (or :meth:`Worker.stop`) drains: stop reading, run what was read, write,
exit; :attr:`Worker.stop_signal` says which signal it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from batchline.config import WorkerSettings, redact_url
from batchline.drivers._base import Call
from batchline.errors import BatcherClosed, BatchlineError, WorkerHung
from batchline.keys import check_name, host_id
from batchline.tracing import flush as flush_spans
from batchline.tracing import worker as worker_trace
from batchline.transport._cancels import CancelLog, CancelTrim
from batchline.transport._errors import ignoring_redis_failures
from batchline.transport._functions import load_library
from batchline.transport._redis import RedisClient, connect, dedicated, pinned, wait_for_redis
from batchline.transport._replication import Replication
from batchline.worker._cpu_threads import apply_threads, available_cpus, prepare_environment
from batchline.worker._ready import ready_line
from batchline.worker.metrics import Metrics
from batchline.worker.models import Model, Prepared, load, load_model
from batchline.worker.serving._admitter import Admitter
from batchline.worker.serving._answers import answer, dead_letter, finished
from batchline.worker.serving._cache import AnswerCache
from batchline.worker.serving._chunk_writer import ChunkWriter
from batchline.worker.serving._executors import build, pads
from batchline.worker.serving._facts import ModelFacts
from batchline.worker.serving._generation_executor import GenerationExecutor
from batchline.worker.serving._intake import Preparer
from batchline.worker.serving._reader import Entries, ReadCap, Reader
from batchline.worker.serving._starts import Starts
from batchline.worker.serving._writer import AnswerWriter
from batchline.worker.shared._consumers import ensure_groups
from batchline.worker.shared._guard import Guard, Stamp
from batchline.worker.shared._held import Claims, Meta, Record
from batchline.worker.upkeep._upkeep import Upkeep, every, snapshot

__all__ = ["Worker"]

logger = logging.getLogger(__name__)


class Worker:
    """Serve one queue: ``await Worker(...).run()`` until SIGTERM or :meth:`stop`.

    Args:
        settings: the worker's settings (default: ``BATCHLINE_*`` variables and ``overrides``).
        model: a :class:`~batchline.worker.models.Model` to serve, or a model spec (the
            ``model`` setting).
        redis: an asyncio Redis client instead of one made from ``redis_url``.
        **overrides: single settings, e.g. ``batch_size=64``.
    """

    def __init__(
        self,
        settings: WorkerSettings | None = None,
        *,
        model: Model | str | None = None,
        redis: RedisClient = None,
        **overrides: Any,
    ) -> None:
        if isinstance(model, str):  # the setting (a model spec), not a model object
            overrides["model"], model = model, None
        self.settings = s = settings or WorkerSettings(**overrides)
        self._model_name = type(model).__name__ if model is not None else s.model
        self.keys = s.keys
        self.worker_id = check_name(
            "worker_id", s.worker_id or f"{host_id()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.threads = s.threads or available_cpus()
        self.model = model or load_model(
            s.model,
            path=s.model_path,
            device=s.device,
            dtype=s.dtype,
            backend=s.backend,
            threads=self.threads,
            calibration=s.calibration,
        )
        self._cache = AnswerCache(s, model)
        self._facts = ModelFacts(s)
        self._own_client = redis is None
        self._redis = redis if redis is not None else connect(s)
        # The writer task's own connection (durability replicated on a cluster: to the node
        # of the queue, where WAIT counts the writes made before it).
        self._writer = (
            pinned(self._redis, self.keys.stream(0))
            if s.durability == "replicated"
            else dedicated(self._redis)
        )
        self._limits = s.limits()
        self._streams_low_first = self.keys.streams_low_first
        # What it holds, and its model calls as the watchdog sees them.
        self._claims = Claims(self._redis, self._streams_low_first, self.worker_id)
        self._meta = self._claims.calls
        self._guard = Guard(
            s,
            self._claims,
            workers_key=self.keys.workers,
            redis=self._redis,
            own=self._own_client,
            bound_file=lambda: self.bound_file,
        )
        self._cancels = CancelLog(
            s.result_ttl_s, max_ids=s.cancel_max_ids, max_bytes=s.cancel_max_bytes
        )
        self._space = asyncio.Event()  # set when the reader may have room again
        self.counts: Counter[str] = Counter()
        # Its spans (batchline.tracing), None when tracing is off.
        self._trace = worker_trace(self.keys.queue, self.worker_id, self._model_name, self.counts)
        starts = Starts(self._claims, self._cancels, self._space, trace=self._trace)
        executors = build(self.model, s, guard=self._guard, starts=starts)
        self._batcher, self._alone = executors.main, executors.alone
        self._window = executors.window
        self._generation = (
            executors.main if isinstance(executors.main, GenerationExecutor) else None
        )
        self._handing_back: set[asyncio.Future[None]] = set()
        self._prep = Preparer(self.model, self._limits, self.worker_id, threads=s.prep_threads)
        self.metrics = Metrics(s.metrics_port)
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.ready = threading.Event()
        #: The signal (SIGTERM, SIGINT) that stopped the worker, if one did.
        self.stop_signal: int | None = None
        self._parts(s)

    def _parts(self, s: WorkerSettings) -> None:
        """The parts the worker owns around its batchers: the reader, the writer, the cancel
        trim and the upkeep."""
        self._cancel_trim = CancelTrim(self._redis, self.keys, s.result_ttl_s)
        self._readcap = ReadCap.within(self._limits, max_read_bytes=s.max_read_bytes)
        self._admit_client = dedicated(self._redis)  # it blocks on the inbox
        self._admitter = Admitter(
            self._admit_client,
            s,
            worker_id=self.worker_id,
        )
        self._admits = False  # whether the queue's functions are loaded (Redis >= 7)
        self._answers = AnswerWriter(
            self._writer,
            self.keys,
            result_ttl_s=s.result_ttl_s,
            claims=self._claims,
            cache=self._cache,
            replication=Replication.of(s),
        )
        self._chunks = ChunkWriter(
            self._redis,
            self.keys,
            ttl_s=s.result_ttl_s,
            max_unread_s=s.stream_max_unread_s,
            cancel=self._cancels.add,  # on this worker alone: its producer is gone
        )
        self._reader = Reader(
            self._redis,
            self._streams_low_first,
            self.worker_id,
            self._readcap,
            room=self._room,
            accept=self._accept,
        )
        self._upkeep = Upkeep(
            self._claims,
            self._guard,
            s,
            self.metrics,
            batcher=self._batcher,
            counts=self.counts,
            serving=self._serving,
            accept=self._accept,
            refuse=self._refuse,
            stats=self.stats,
        )

    #: End the process if a hung model call blocks the event loop (``batchline worker``).
    exit_if_loop_blocked = False
    #: Where the slowest recent model call is remembered for the next worker process
    #: (``batchline worker``'s supervisor): ``max_batch_ms`` auto starts from it.
    bound_file: Path | None = None

    def __repr__(self) -> str:
        return f"<Worker {self.worker_id} queue={self.keys.queue!r}>"

    def stats(self) -> dict[str, Any]:
        """This worker's statistics, as published with its heartbeat."""
        return snapshot(
            worker_id=self.worker_id,
            model_name=self._model_name,
            counts=self.counts,
            stats=self._batcher.stats,
            prepare=self._prep.stats(),
            max_batch_ms=self._guard.bound.limit_s() * 1e3,
        )

    def _serving(self) -> bool:
        """Reading, reclaiming: not stopping, not hung, no call running long (slow)."""
        if self._stop is None or self._stop.is_set() or self._guard.hung.is_set():
            return False
        return not self._guard.slow

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Load the model, serve until stopped, then drain and return."""
        loop = self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        hung = asyncio.Event()
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

        watchdog = self._upkeep.watchdog.start(
            loop,
            on_slow=self._on_slow,
            on_hung=on_hung,
            exit_if_loop_blocked=self.exit_if_loop_blocked,
        )
        self.ready.set()
        logger.info(
            "%s",
            ready_line(
                self.model, self._model_name, self.settings, generation=self._generation is not None
            ),
        )
        stopped = loop.create_task(self._stop.wait())
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
        if self._guard.hung.is_set():
            raise WorkerHung(
                f"worker {self.worker_id}: a model call ran past its bound "
                f"(max_batch_ms={self.settings.max_batch_ms})"
            )
        if crashed:
            # Exit non-zero so that a supervisor restarts the worker.
            raise RuntimeError(f"worker {self.worker_id} stopped: a task failed") from crashed[0]

    async def _started(self, loop: asyncio.AbstractEventLoop) -> bool:
        """:meth:`_start`, unless :meth:`stop` comes first (False: it closed what it opened;
        a model still loading on its thread finishes there)."""
        if self._stop is None:  # pragma: no cover - run() sets it
            raise RuntimeError("the worker is not running")
        starting = loop.create_task(self._start(loop), name="batchline-start")
        stopped = loop.create_task(self._stop.wait())
        try:
            await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if starting.done():
            starting.result()  # what it raised (Redis unreachable, a model that fails)
            return True
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        self._prep.close()
        self.metrics.stop()
        for own in (self._writer, self._admit_client):
            if own is not self._redis:
                await own.aclose()
        if self._own_client:
            await self._redis.aclose()
        return False

    async def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Reach Redis, load the model, create the groups, catch up on cancels."""
        logger.info(
            "worker %s: queue %r on %s, model %s, event loop %s",
            self.worker_id,
            self.keys.queue,
            redact_url(self.settings.redis_url.get_secret_value()),
            self._model_name,
            type(loop).__module__.split(".")[0],
        )
        await wait_for_redis(self._redis, self.settings, wait_s=self.settings.redis_wait_s)
        prepare_environment(self.threads)  # before the model loads torch (or anything)
        s = self.settings
        loading = functools.partial(
            load, self.model, spec=self._model_name, path=s.model_path, device=s.device
        )
        await loop.run_in_executor(None, loading)
        apply_threads(self.threads)
        await loop.run_in_executor(
            None,
            lambda: self._guard.measure(
                self.model if self._generation is None else None,
                pads=pads(self.model),
                padding=getattr(self._batcher, "record_padding", None),
            ),
        )
        self._prep.start()
        await ensure_groups(self._redis, self._streams_low_first)
        self._admits = await load_library(self._redis, self.keys)
        await self._cache.publish(self._redis)
        self._facts.load(self.model)
        await self._facts.publish(self._redis)
        if self._admits:  # what waits, before the first read: highest priority read first
            await self._admitter.admit_all()
        await self._cancels.catch_up(self._redis, self.keys)
        self.metrics.start()

    def _start_tasks(self, loop: asyncio.AbstractEventLoop) -> list[asyncio.Task[None]]:
        """The reader (first) and the upkeep tasks."""
        jobs = {
            "reader": self._read(),
            **self._upkeep.jobs(lambda: self._closing),
            "cancels": self._cancels.follow(self._redis, self.keys, lambda: not self._closing),
            "cancel-trim": every(
                self.settings.claim_idle_ms / 3e3,
                "cancel trim",
                self._cancel_trim.step,
                lambda: self._closing,
            ),
            "cache": every(
                self.settings.heartbeat_s,
                "cache",
                lambda: self._cache.beat(self._redis, self.metrics),
                lambda: self._closing,
            ),
            "facts": every(
                self.settings.heartbeat_s,
                "facts",
                lambda: self._facts.publish(self._redis),
                lambda: self._closing,
            ),
        }
        if self._admits:
            jobs["admitter"] = self._admitter.run(lambda: not self._closing)
        return [loop.create_task(job, name=f"batchline-{name}") for name, job in jobs.items()]

    async def _close(self, tasks: list[asyncio.Task[None]]) -> None:
        # Cancelling alone is not enough on Python 3.11: a cancellation that lands just as
        # redis-py's internal wait_for completes is swallowed, so the loops also end on this.
        self._closing = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *self._handing_back, return_exceptions=True)
        with ignoring_redis_failures():
            await self._redis.zrem(self.keys.workers, self.worker_id)
        self._prep.close()
        self.metrics.stop()
        for own in (self._writer, self._admit_client):
            if own is not self._redis:
                await own.aclose()
        if self._own_client:
            await self._redis.aclose()
        answered = ", ".join(f"{n} {status}" for status, n in sorted(self.counts.items()) if n)
        logger.info("worker %s: stopped (answered %s)", self.worker_id, answered or "nothing")
        if self._trace is not None:
            await asyncio.get_running_loop().run_in_executor(None, flush_spans)

    async def _drain_or_abandon(self, reader: asyncio.Task[None], hung: asyncio.Event) -> None:
        """Drain (run what was read, write its answers); if the model hangs, before or
        during the drain, hand back what is held instead."""
        drain = asyncio.ensure_future(self._drain(reader))
        hang = asyncio.ensure_future(hung.wait())
        await asyncio.wait({drain, hang}, return_when=asyncio.FIRST_COMPLETED)
        hang.cancel()
        if drain.done():
            drain.result()
            return
        await self._guard.abandon()  # at once: not after the drain, nor after the next read
        drain.cancel()
        await asyncio.gather(drain, return_exceptions=True)
        if not reader.done():
            await reader  # returns after its current read (at most one block interval)
        await self._guard.abandon()  # what that read brought in
        await self._answers.drain()  # the answers already computed
        # Nothing is answered from here on: abandon() forgot every call held.
        self._batcher.close()
        self._alone.close()

    def _on_slow(self, call: Stamp) -> None:
        """A model call runs long (on the loop, from the watchdog): its read-ahead goes back
        (:meth:`Guard.release`; a generation worker keeps its few)."""
        if not self._serving() or self._generation is not None:
            return
        task = self._guard.release(call)
        if task is not None:
            self._handing_back.add(task)
            task.add_done_callback(self._handing_back.discard)

    async def _drain(self, reader: asyncio.Task[None]) -> None:
        if not reader.done():
            # Shielded: cancelling the drain (the model hung) must not cut a read short,
            # whose entries would then be this worker's without its knowing.
            await asyncio.shield(reader)  # returns after its current read (one block interval)
        await self._alone.aclose(drain=True)
        await self._batcher.aclose(drain=True)
        await self._chunks.drain()
        await self._answers.drain()

    def stop(self) -> None:
        """Drain and stop; callable from any thread and from signal handlers."""
        loop, stop = self._loop, self._stop
        if loop is None or stop is None or loop.is_closed():
            return
        if _running_loop() is loop:
            stop.set()
            self._space.set()
        else:
            loop.call_soon_threadsafe(self.stop)

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig)

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

    # -- reading -------------------------------------------------------------------------------

    async def _read(self) -> None:
        if self._stop is None:  # pragma: no cover - run() sets it
            raise RuntimeError("the worker is not running")
        await self._reader.run(self._space, self._stop)

    def _room(self) -> int:
        """How many more entries the reader may bring in (none while a call runs long)."""
        if not self._serving():
            return 0
        return self._window - self._batcher.queue_size - self._prep.preparing

    async def _accept(self, entries: Entries, *, alone: bool = False) -> None:
        batch, too_large = self._readcap.split(list(entries))
        for sidx, entry, _raw in batch:
            self._claims.hold(sidx, entry)
        for (sidx, entry, raw), size in too_large:  # dead-lettered unread
            self._claims.hold(sidx, entry)
            limit = self._readcap.max_entry_bytes
            reason = f"entry of {size} bytes exceeds the largest request ({limit} bytes)"
            self._refuse(sidx, entry, raw or {}, "MalformedRequest", reason)
        trace = self._trace
        for outcome in await self._prep(batch):
            if isinstance(outcome, Record):
                self._answer(outcome)
            else:
                if trace is not None:
                    delivered = self._claims.deliveries.get(outcome[0].entry, 1) if alone else 1
                    trace.received(outcome[0], delivered)
                self._submit(*outcome, alone=alone)

    def _submit(self, meta: Meta, prepared: list[Prepared], *, alone: bool = False) -> None:
        request = meta.request
        deadline = None
        deadline_ms = request.get("dl")
        if deadline_ms is not None:
            deadline = time.monotonic() + (deadline_ms / 1e3 - time.time())
        try:
            call = (self._alone if alone else self._batcher).enqueue(
                prepared, self._done, deadline=deadline, priority=meta.sidx
            )
        except BatcherClosed:
            # Shutting down (a reclaim raced the drain): leave the entry pending, unheld,
            # for another worker.
            self._claims.drop(meta.sidx, meta.entry)
            return
        except BatchlineError as exc:  # ItemTooLarge: this request alone fails
            self._answer(answer(meta, "error", self.worker_id, error=exc), meta)
            return
        self._meta[call] = meta
        reply = request.get("reply")
        if request.get("stream") and reply and self._generation is not None:
            # Chunks carry the input hash, as results do: producers check it.
            self._generation.stream(call, self._chunks.to(reply, request["id"], meta.input_hash()))

    # -- answering -----------------------------------------------------------------------------

    def _done(self, call: Call) -> None:
        meta = self._meta.pop(call, None)
        if meta is None:
            return
        self._space.set()  # it left the queue (answered, expired or cancelled): read more
        record = finished(meta, call, self.model, self.worker_id)
        if self._trace is not None:
            generation = self._generation is not None and call.error is None
            self._trace.answered(record, meta, call.results if generation else None)
        self._answer(record)

    def _refuse(
        self, sidx: int, entry: bytes, raw: dict[bytes, bytes], kind: str, reason: str
    ) -> None:
        """Dead-letter one entry (unread: too large; or delivered too often)."""
        self._answer(dead_letter(sidx, entry, raw, kind, reason, worker_id=self.worker_id))

    def _answer(self, record: Record, meta: Meta | None = None) -> None:
        if self._trace is not None and (meta is not None or record.dead is not None):
            self._trace.answered(record, meta)
        self.counts[record.status] += 1
        self.metrics.result(record.status)
        self._answers.put(record)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
