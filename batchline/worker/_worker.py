"""The worker: read requests from Redis, batch them with the core, run the model, answer.

Tasks on one event loop, so that Redis I/O and decoding overlap the model's compute (which
runs on the batcher's own thread, or on the loop for a model quick enough, see
:class:`~batchline.core.pace.Pace`):

- the *reader* fills the batch policy from ``XREADGROUP`` (all priority streams, highest
  first), keeping at most ``read_ahead`` batches ahead of the model; decoding and tokenizing
  run on a thread of their own for tokenizer-backed models;
- the *model batcher* is the asyncio driver of the in-process core (same policy, same
  isolation, same padding): batch size, timeout, token budget, priorities, deadlines and
  length grouping all come from there;
  for ``--model generate`` an executor with the same small interface runs continuous
  batching instead (:mod:`._generate`);
- the *writer* coalesces finished requests into one call of the completion script per batch,
  which acknowledges each entry and, only if the acknowledgement took, writes its result
  (with its TTL) and pushes the replies, then deletes the entries;
- the *cancel follower* reads the queue's cancel stream (:mod:`batchline._cancels`);
- the *janitor* keeps this worker's claims alive during long batches, the *reclaimer*
  takes over entries that dead workers left pending (XAUTOCLAIM), dead-lettering those
  delivered too often, and the *heartbeat* publishes liveness and statistics (all in
  :mod:`._upkeep`).

Containment. An entry delivered more than once may be what killed its last worker, so it
never shares a model call again: the reclaimer takes such entries one at a time and runs
each alone (on a second batcher of batch size 1 that shares the model's lock), so a poison
input crashes only itself, and its batch-mates, already redelivered, are answered.
``max_batch_ms`` bounds one model call: a watchdog thread marks the worker hung, and then it
stops reading and renewing, signs off (no heartbeat), hands back what it holds with
``XCLAIM ... IDLE <claim_idle_ms>`` so another worker's XAUTOCLAIM takes it at once (entries
not started keep their delivery count, ``RETRYCOUNT``), writes the answers already computed,
and :meth:`Worker.run` raises :class:`~batchline.errors.WorkerHung`. A Python thread cannot
be killed, so the process must end: ``batchline worker`` runs the worker in a child process
and starts a fresh one (:mod:`._supervisor`).

SIGTERM (or :meth:`Worker.stop`) drains: stop reading, run what was read, write, exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import msgpack
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from batchline._aio import AioBatcher
from batchline._base import BatchConfig, Call, Item
from batchline._cancels import CancelLog
from batchline._redis import Backoff, Script, connect, dedicated, own_connection, wait_for_redis
from batchline._scripts import COMPLETE
from batchline.codec import DecodeError, check_priority, decode_requests, request_value
from batchline.config import WorkerSettings, redact_url
from batchline.errors import (
    BatcherClosed,
    BatchlineError,
    RequestCancelled,
    RequestTimeout,
    WorkerHung,
)
from batchline.keys import GROUP, check_name
from batchline.worker._answers import Meta, Record, answer, dead_letter
from batchline.worker._generate import Executor, GenerationExecutor, GenerationModel
from batchline.worker._readcap import ENTRY_SLACK_BYTES, ReadCap
from batchline.worker._upkeep import Upkeep
from batchline.worker.metrics import Metrics
from batchline.worker.models import Model, Prepared, load_model

__all__ = ["Worker"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_REPLY_MAXLEN = 100_000
_DEAD_MAXLEN = 100_000


class Worker(Upkeep):
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
        redis: Any = None,
        **overrides: Any,
    ) -> None:
        if isinstance(model, str):  # the setting (a model spec), not a model object
            overrides["model"], model = model, None
        self.settings = s = settings or WorkerSettings(**overrides)
        self._model_name = type(model).__name__ if model is not None else s.model
        self.keys = s.keys
        host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
        self.worker_id = check_name(
            "worker_id", s.worker_id or f"{host[:40]}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.model = model or load_model(s.model, path=s.model_path, device=s.device, dtype=s.dtype)
        self._own_client = redis is None
        self._redis = redis if redis is not None else connect(s)
        self._writer = dedicated(self._redis)  # the writer task's own connection
        self._limits = s.limits()
        self._streams_low_first = [self.keys.stream(p) for p in range(self.keys.priorities)]
        self._sidx = {name.encode(): i for i, name in enumerate(self._streams_low_first)}
        self._window = s.batch_size * s.read_ahead
        self._readcap = ReadCap(
            max_read_bytes=s.max_read_bytes,
            max_entry_bytes=self._limits.max_meta_bytes
            + self._limits.max_blob_bytes
            + ENTRY_SLACK_BYTES,
        )
        # No batch is handed to the model's thread ahead of time: cancellations and deadlines
        # are checked as a batch starts, which must be when the model is free to run it (a
        # real model's batch takes far longer than the wait this would save).
        batcher: AioBatcher[Prepared, Any] = AioBatcher(
            self._infer,
            BatchConfig(
                batch_size=s.batch_size,
                timeout_ms=s.timeout_ms,
                small_batch_threshold=0,
                max_tokens=s.max_tokens,
                length_fn=_length,
                # Grouping similar lengths pays only where the model pads (optional attribute).
                group_by_length=bool(getattr(self.model, "pads", True)),
                group_window=s.read_ahead,
            ),
            max_concurrent_batches=1,
            on_batch_start=self._before_batch,
        )
        self._fn_lock = batcher._fn_lock
        # Entries delivered more than once run here, alone, never inline on the loop (the
        # model's lock may be held by a batch of the main batcher).
        self._alone: Executor = AioBatcher(
            self._infer_alone,
            BatchConfig(batch_size=1, timeout_ms=0, small_batch_threshold=0, inline_below_ms=0),
            max_concurrent_batches=1,
            on_batch_start=self._before_batch,
        )
        self._batcher: Executor = batcher
        if isinstance(self.model, GenerationModel):  # continuous batching instead
            gen = GenerationExecutor(
                self.model,
                s,
                guard=self._guarded,
                on_start=self._mark_started,
                cancelled=self._is_cancelled,
            )
            self._batcher, self._alone, self._window = gen, gen.alone, gen.window
        self._deliveries: dict[bytes, int] = {}  # of reclaimed entries held
        self._model_since: float | None = None  # monotonic start of the model call running
        self._hung = threading.Event()
        self._settled: asyncio.Event | None = None
        # Answers wait here while a write is in flight; the next write takes them all (the
        # same coalescing as a batcher with timeout 0, without its per-record overhead).
        self._outbox: list[Record] = []
        self._flusher: asyncio.Task[None] | None = None
        self._complete = Script(COMPLETE)
        self._meta: dict[Call, Meta] = {}
        self._cancels = CancelLog(
            s.result_ttl_s, max_ids=s.cancel_max_ids, max_bytes=s.cancel_max_bytes
        )
        self._inflight: list[set[bytes]] = [set() for _ in self._streams_low_first]
        self._preparing = 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.counts: Counter[str] = Counter()
        self.metrics = Metrics(s.metrics_port)
        self._stop: asyncio.Event | None = None
        self._space: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.ready = threading.Event()

    def __repr__(self) -> str:
        return f"<Worker {self.worker_id} queue={self.keys.queue!r}>"

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Load the model, serve until stopped, then drain and return."""
        loop = self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._space = asyncio.Event()
        self._settled = asyncio.Event()
        hung = asyncio.Event()
        logger.info(
            "worker %s: queue %r on %s, model %s",
            self.worker_id,
            self.keys.queue,
            redact_url(self.settings.redis_url.get_secret_value()),
            self._model_name,
        )
        await wait_for_redis(self._redis, self.settings, wait_s=self.settings.redis_wait_s)
        await loop.run_in_executor(None, self.model.load)
        if self.model.heavy_preprocess:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="batchline-prep"
            )
        await self._ensure_groups()
        await self._cancels.catch_up(self._redis, self.keys)
        self._install_signals(loop)
        self.metrics.start()
        reader = loop.create_task(self._read(), name="batchline-reader")
        janitor = loop.create_task(self._janitor(), name="batchline-janitor")
        reclaimer = loop.create_task(self._reclaimer(), name="batchline-reclaimer")
        heartbeat = loop.create_task(self._heartbeat(), name="batchline-heartbeat")
        cancels = loop.create_task(
            self._cancels.follow(self._redis, self.keys, lambda: not self._closing),
            name="batchline-cancels",
        )
        tasks = (reader, janitor, reclaimer, heartbeat, cancels)
        watchdog = self._start_watchdog(loop, hung)
        self.ready.set()
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
            # Cancelling alone is not enough on Python 3.11: a cancellation that lands just as
            # redis-py's internal wait_for completes is swallowed, so the loops also end on this.
            self._closing = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(RedisError, OSError):
                await self._redis.zrem(self.keys.workers, self.worker_id)
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self.metrics.stop()
            if self._writer is not self._redis:
                await self._writer.aclose()
            if self._own_client:
                await self._redis.aclose()
            logger.info("worker %s: stopped (%s)", self.worker_id, dict(self.counts))
        if self._hung.is_set():
            raise WorkerHung(
                f"worker {self.worker_id}: a model call ran past "
                f"max_batch_ms={self.settings.max_batch_ms}"
            )
        if crashed:
            # Exit non-zero so that a supervisor restarts the worker.
            raise RuntimeError(f"worker {self.worker_id} stopped: a task failed") from crashed[0]

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
        drain.cancel()
        await asyncio.gather(drain, return_exceptions=True)
        if not reader.done():
            await reader  # returns after its current read (at most one block interval)
        with contextlib.suppress(RedisError, OSError):
            await self._redis.zrem(self.keys.workers, self.worker_id)  # unhealthy at once
        await self._hand_back()
        while self._flusher is not None:  # the answers already computed
            await self._flusher
        # Nothing is answered from here on: _hand_back forgot every call still held.
        self._batcher.close()
        self._alone.close()

    async def _drain(self, reader: asyncio.Task[None]) -> None:
        if not reader.done():
            await reader  # returns after its current read (at most one block interval)
        await self._alone.aclose(drain=True)
        await self._batcher.aclose(drain=True)
        while self._flusher is not None:
            await self._flusher

    def stop(self) -> None:
        """Drain and stop; callable from any thread and from signal handlers."""
        loop, stop = self._loop, self._stop
        if loop is None or stop is None:
            return

        def _set() -> None:
            stop.set()
            if self._space is not None:
                self._space.set()

        if loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            _set()
        else:
            loop.call_soon_threadsafe(_set)

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop)

    async def _ensure_groups(self) -> None:
        for stream in self._streams_low_first:
            try:
                await self._redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # -- reading -------------------------------------------------------------------------------

    async def _read(self) -> None:
        space = self._space
        stop = self._stop
        if space is None or stop is None:  # pragma: no cover - run() sets both
            raise RuntimeError("the worker is not running")
        async with own_connection(self._redis) as client:  # for the blocking reads
            await self._read_with(client, space, stop)

    async def _read_with(self, client: Any, space: asyncio.Event, stop: asyncio.Event) -> None:
        streams = {name: ">" for name in reversed(self._streams_low_first)}
        backoff = Backoff(logger, "reader")
        while not stop.is_set():
            room = self._window - self._batcher.queue_size - self._preparing
            # COUNT applies to each stream: split the room so the total stays within it,
            # and within max_read_bytes of entries as large as the largest seen lately.
            per_stream = self._readcap.count(room, len(streams))
            if room <= 0:
                space.clear()
                await space.wait()
                continue
            try:
                response = await client.xreadgroup(
                    GROUP, self.worker_id, streams, count=per_stream, block=1000
                )
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                logger.warning("consumer group missing (Redis lost its data?); creating it again")
                await self._ensure_groups()
                continue
            except (RedisError, OSError) as exc:
                await backoff.wait(exc)
                continue
            backoff.reset()
            if response:
                await self._accept(
                    (self._sidx[stream], entry, raw)
                    for stream, entries in response
                    for entry, raw in entries
                )

    async def _accept(
        self,
        entries: Iterable[tuple[int, bytes, dict[bytes, bytes] | None]],
        *,
        alone: bool = False,
    ) -> None:
        batch, too_large = self._readcap.split(list(entries))
        for sidx, entry, _raw in batch:
            self._inflight[sidx].add(entry)
        for (sidx, entry, raw), size in too_large:  # dead-lettered unread
            self._inflight[sidx].add(entry)
            limit = self._readcap.max_entry_bytes
            reason = f"entry of {size} bytes exceeds the largest request ({limit} bytes)"
            self._answer(self._dead_letter(sidx, entry, raw or {}, "MalformedRequest", reason))
        if self._pool is not None:
            self._preparing += len(batch)
            try:
                loop = asyncio.get_running_loop()
                outcomes = await loop.run_in_executor(self._pool, self._prepare_all, batch)
            finally:
                self._preparing -= len(batch)
        else:
            outcomes = self._prepare_all(batch)
        for outcome in outcomes:
            if isinstance(outcome, Record):
                self._answer(outcome)
            else:
                self._submit(*outcome, alone=alone)

    def _prepare_all(
        self, batch: list[tuple[int, bytes, dict[bytes, bytes] | None]]
    ) -> list[Record | tuple[Meta, list[Prepared]]]:
        """Decode, validate and preprocess entries (off the event loop for heavy models)."""
        now = time.time()
        out: list[Record | tuple[Meta, list[Prepared]]] = []
        requests = iter(decode_requests([raw for _sidx, _entry, raw in batch if raw]))
        for sidx, entry, raw in batch:
            if not raw:  # deleted while pending: nothing to answer, only to acknowledge
                out.append(Record(sidx, entry))
                continue
            request = next(requests)
            try:
                if isinstance(request, DecodeError):
                    raise request
                check_priority(request, sidx)  # the stream decides
                value = request_value(request, self._limits)
            except DecodeError as exc:
                out.append(self._dead_letter(sidx, entry, raw, "MalformedRequest", str(exc)))
                continue
            meta = Meta(sidx, entry, request, value, now)
            deadline_ms = request.get("dl")
            if deadline_ms is not None and deadline_ms <= now * 1e3:
                out.append(self._record(meta, "expired"))
                continue
            try:
                prepared = self.model.preprocess(value)
            except Exception as exc:  # the input's fault: this request alone fails
                out.append(self._record(meta, "error", error=exc))
                continue
            out.append((meta, prepared))
        return out

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
            self._inflight[meta.sidx].discard(meta.entry)
            return
        except BatchlineError as exc:  # ItemTooLarge: this request alone fails
            self._answer(self._record(meta, "error", error=exc))
            return
        self._meta[call] = meta

    # -- running -------------------------------------------------------------------------------

    def _guarded(self, fn: Callable[[], T]) -> T:
        # Model calls are serialised (the batchers' lock): one stamp tells the watchdog.
        self._model_since = time.monotonic()
        try:
            return fn()
        finally:
            self._model_since = None

    def _infer(self, batch: list[Prepared]) -> Any:
        return self._guarded(lambda: self.model.infer([p.payload for p in batch]))

    def _infer_alone(self, batch: list[Prepared]) -> Any:
        with self._fn_lock:  # never beside a batch of the main batcher
            return self._infer(batch)

    async def _before_batch(self, batch: list[Item]) -> None:
        if self._space is not None:
            self._space.set()
        calls = list(dict.fromkeys(item.call for item in batch))
        self._mark_started(calls, len(batch))
        if not self._cancels:
            return
        for call in calls:
            if self._is_cancelled(call):
                call.reject(
                    RequestCancelled("cancelled by its producer before a worker started it")
                )

    def _mark_started(self, calls: list[Call], batch_size: int) -> None:
        """These calls start, in a batch of ``batch_size`` (any thread: plain writes)."""
        now = time.time()
        for call in calls:
            meta = self._meta.get(call)
            if meta is not None:
                meta.started_unix = now
                meta.batch_size = batch_size

    def _is_cancelled(self, call: Call) -> bool:
        meta = self._meta.get(call) if self._cancels else None
        return meta is not None and meta.request["id"] in self._cancels

    def _done(self, call: Call) -> None:
        meta = self._meta.pop(call, None)
        if meta is None:
            return
        if self._space is not None:
            self._space.set()  # it left the queue (answered, expired or cancelled): read more
        if call.error is None:
            try:
                output = self.model.postprocess(call.results, meta.value)
            except Exception as exc:
                self._answer(self._record(meta, "error", error=exc))
                return
            self._answer(self._record(meta, "ok", output=output))
        elif isinstance(call.error, RequestCancelled):
            self._answer(self._record(meta, "cancelled"))
        elif isinstance(call.error, RequestTimeout):
            self._answer(self._record(meta, "expired"))
        else:
            self._answer(self._record(meta, "error", error=call.error))

    def _record(
        self, meta: Meta, status: str, *, output: Any = None, error: BaseException | None = None
    ) -> Record:
        return answer(meta, status, self.worker_id, output=output, error=error)

    def _dead_letter(
        self, sidx: int, entry: bytes, raw: dict[bytes, bytes], kind: str, reason: str
    ) -> Record:
        return dead_letter(sidx, entry, raw, kind, reason, worker_id=self.worker_id)

    def _answer(self, record: Record) -> None:
        self.counts[record.status] += 1
        self.metrics.result(record.status)
        self._outbox.append(record)
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    # -- writing -------------------------------------------------------------------------------

    async def _flush(self) -> None:
        try:
            while self._outbox:
                records, self._outbox = self._outbox, []
                try:
                    await self._write(records)
                except (RedisError, OSError) as exc:
                    # Unanswered entries stay pending; no longer kept alive by this worker,
                    # they go idle and are reclaimed and answered later.
                    logger.error("writer: %d answers not written: %s", len(records), exc)
                    self._settle(records)
        finally:
            self._flusher = None

    async def _write(self, records: list[Record]) -> None:
        packed = []
        for r in records:
            has_result = r.result is not None and r.request_id is not None
            packed.append(
                [
                    r.sidx,
                    r.entry,
                    r.request_id or "" if has_result else "",
                    r.reply or "" if has_result else "",
                    r.dead or [],
                    r.result if has_result else "",
                ]
            )
        keys = [*self._streams_low_first, self.keys.dead]
        args = [
            GROUP,
            self.settings.result_ttl_s,
            _REPLY_MAXLEN,
            _DEAD_MAXLEN,
            self.keys.result(""),
            self.keys.reply(""),
            msgpack.packb(packed, use_bin_type=False),
        ]
        await self._with_retry(lambda: self._complete(self._writer, keys, args))
        self._settle(records)

    def _settle(self, records: list[Record]) -> None:
        """These entries are no longer this worker's to keep alive."""
        for r in records:
            self._inflight[r.sidx].discard(r.entry)
            self._deliveries.pop(r.entry, None)
        if self._settled is not None:
            self._settled.set()

    async def _with_retry(self, attempt: Any, budget_s: float = 30.0) -> Any:
        """Retry a write through a Redis restart; past the budget the entries stay pending
        (and are reclaimed and answered later), so nothing is lost either way."""
        delay, waited = 0.05, 0.0
        while True:
            try:
                return await attempt()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                if waited >= budget_s:
                    raise
                logger.warning("writer: %s; retrying in %.2f s", type(exc).__name__, delay)
                await asyncio.sleep(delay)  # back-off after a failed write, not a poll
                waited += delay
                delay = min(delay * 2, 1.0)
            except ResponseError as exc:
                # Loading its data after a restart, or out of memory (maxmemory, noeviction):
                # states Redis leaves, so wait them out; the entries stay pending meanwhile.
                passing = isinstance(exc, OutOfMemoryError) or "LOADING" in str(exc)
                if not (passing or "OOM" in str(exc)) or waited >= budget_s:
                    raise
                logger.warning("writer: %s; retrying in %.2f s", exc, delay)
                await asyncio.sleep(delay)
                waited += delay
                delay = min(delay * 2, 1.0)


def _length(prepared: Prepared) -> int:
    return prepared.length
