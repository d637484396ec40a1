"""A request's way through a worker, owned by one object: :class:`Serving` takes in the
entries the reader (and the reclaimer) bring (:meth:`Serving.accept`: held, checked against
the read cap, prepared), hands each request to its executor (:meth:`Serving.submit`), makes
the record of each call that leaves it (:meth:`Serving.done`, the executor's ``wake``) and
puts that record out (:meth:`Serving.answer`, to the writer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from batchline.codec import request_tenant
from batchline.drivers._base import Call
from batchline.errors import BatcherClosed, BatchlineError
from batchline.worker.metrics import Metrics
from batchline.worker.models import Model, Prepared
from batchline.worker.serving._answers import Unprepared, answer, dead_letter, finished
from batchline.worker.serving._chunk_writer import ChunkWriter
from batchline.worker.serving._dispatch import Dispatcher
from batchline.worker.serving._executors import Executors
from batchline.worker.serving._generation_executor import GenerationExecutor
from batchline.worker.serving._intake import Preparer
from batchline.worker.serving._reader import ReadCap
from batchline.worker.serving._writer import AnswerWriter
from batchline.worker.shared._guard import Guard
from batchline.worker.shared._held import Claims, Entry, Meta, Record

if TYPE_CHECKING:
    from batchline.tracing._otel import WorkerTrace

__all__ = ["Serving"]

logger = logging.getLogger(__name__)


class Serving:
    """The serving path of one worker: see the module docstring. It is the
    :class:`~batchline.worker.shared._roles.Entrance` of the reader and the reclaimer.

    Args:
        model: the model served (its ``postprocess`` makes each output).
        worker_id: the worker's consumer name (in every result).
        claims: what the worker holds (each call's metadata while it runs).
        guard: the worker's model calls (nothing is read while one hangs or runs long).
        readcap: the read cap (entries too large for any request are dead-lettered unread).
        prep: decodes, validates and preprocesses what comes in.
        executors: the executors of the model, and the entries the worker may hold.
        answers: the writer of the answers.
        chunks: the writer of streamed tokens (generation).
        space: set whenever room frees up for the reader.
        counts: the answers by status (the worker's ``counts``).
        metrics: the worker's metrics (each answer's status).
        trace: the worker's spans (None: tracing off).
        dispatcher: the fair share's side of the worker (its window while requests are
            held; the real cost of each request answered).

    Attributes:
        stopped: set once the worker stops (drains): nothing more is read or reclaimed.
    """

    def __init__(
        self,
        model: Model,
        worker_id: str,
        *,
        claims: Claims,
        guard: Guard,
        readcap: ReadCap,
        prep: Preparer,
        executors: Executors,
        answers: AnswerWriter,
        chunks: ChunkWriter,
        space: asyncio.Event,
        counts: Counter[str],
        metrics: Metrics,
        trace: WorkerTrace | None = None,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        self._model = model
        self._worker_id = worker_id
        self._claims = claims
        self._meta = claims.calls
        self._guard = guard
        self._readcap = readcap
        self._prep = prep
        self._batcher, self._alone = executors.main, executors.alone
        self._window = executors.window
        main = executors.main
        self._generation = main if isinstance(main, GenerationExecutor) else None
        self._answers = answers
        self._chunks = chunks
        self._space = space
        self._counts = counts
        self._metrics = metrics
        self._trace = trace
        self._dispatcher = dispatcher
        self._room_timer: asyncio.TimerHandle | None = None
        self.stopped = asyncio.Event()

    def stop(self) -> None:
        """Stop reading and reclaiming (on the worker's loop); what was read is answered."""
        self.stopped.set()
        self._space.set()

    @property
    def open(self) -> bool:
        """Reading, reclaiming: not stopping, not hung, no call running long (slow), the
        model not failing to load."""
        guard = self._guard
        return not (
            self.stopped.is_set()
            or guard.hung.is_set()
            or guard.slow
            or guard.load_failing.is_set()
        )

    def room(self) -> int:
        """How many more entries the reader may bring in (none while it is not open)."""
        if not self.open:
            return 0
        window = self._window
        if self._dispatcher is not None:
            window, opens_s = self._dispatcher.window(window, since=self._running_since)
            if opens_s > 0:
                self._open_in(opens_s)
        return window - self._batcher.queue_size - self._prep.preparing

    def _running_since(self) -> float | None:
        """When the batch under way started (unix seconds), None if none runs."""
        return min((m.started_unix for m in self._meta.values() if m.started_unix), default=None)

    def _open_in(self, delay_s: float) -> None:
        """Wake the reader in ``delay_s`` (room opens then), unless it is woken sooner."""
        loop = asyncio.get_running_loop()
        timer = self._room_timer
        if timer is not None and timer.when() <= loop.time() + delay_s:
            return
        if timer is not None:
            timer.cancel()
        self._room_timer = loop.call_later(delay_s, self._room_opens)

    def _room_opens(self) -> None:
        self._room_timer = None
        self._space.set()

    def prepare_stats(self) -> dict[str, Any]:
        """What the intake prepared so far (:meth:`Preparer.stats`)."""
        return self._prep.stats()

    # -- the way in ----------------------------------------------------------------------------

    async def accept(self, entries: Iterable[Entry], *, alone: bool = False) -> None:
        """Hold the entries of one read (or one reclaimed entry), prepare them and submit
        each request; those answered at once (malformed, expired, too large, ...) are."""
        batch, too_large = self._readcap.split(list(entries))
        if self._dispatcher is not None:
            self._dispatcher.read(batch)
        for sidx, entry, _raw in batch:
            self._claims.hold(sidx, entry)
        for (sidx, entry, raw), size in too_large:  # dead-lettered unread
            self._claims.hold(sidx, entry)
            limit = self._readcap.max_entry_bytes
            reason = f"entry of {size} bytes exceeds the largest request ({limit} bytes)"
            self.refuse(sidx, entry, raw or {}, "MalformedRequest", reason)
        trace = self._trace
        unprepared: list[Meta] = []
        for outcome in await self._prep(batch):
            if isinstance(outcome, Record):
                self.answer(outcome)
            elif isinstance(outcome, Unprepared):
                unprepared.append(outcome.meta)
            else:
                if trace is not None:
                    delivered = self._claims.deliveries.get(outcome[0].entry, 1) if alone else 1
                    trace.received(outcome[0], delivered)
                self.submit(*outcome, alone=alone)
        if unprepared:  # the model, loaded by demand, did not load for them
            self._metrics.unhealthy()
            await self._guard.cannot_load(unprepared)

    def submit(self, meta: Meta, prepared: list[Prepared], *, alone: bool = False) -> None:
        """Hand one request's prepared items to its executor (``alone``: the one that runs
        each alone); :meth:`done` is called once it leaves."""
        request = meta.request
        deadline = None
        deadline_ms = request.get("dl")
        if deadline_ms is not None:
            deadline = time.monotonic() + (deadline_ms / 1e3 - time.time())
        try:
            call = (self._alone if alone else self._batcher).enqueue(
                prepared, self.done, deadline=deadline, priority=meta.sidx
            )
        except BatcherClosed:
            # Shutting down (a reclaim raced the drain): leave the entry pending, unheld,
            # for another worker.
            self._claims.drop(meta.sidx, meta.entry)
            return
        except BatchlineError as exc:  # ItemTooLarge: this request alone fails
            self.answer(answer(meta, "error", self._worker_id, error=exc), meta)
            return
        self._meta[call] = meta
        reply = request.get("reply")
        if request.get("stream") and reply and self._generation is not None:
            # Chunks carry the input hash, as results do: producers check it.
            self._generation.stream(call, self._chunks.to(reply, request["id"], meta.input_hash()))

    # -- the way out ---------------------------------------------------------------------------

    def done(self, call: Call) -> None:
        """A call left its executor (answered, failed, expired or cancelled): answer it."""
        meta = self._meta.pop(call, None)
        if meta is None:
            return
        self._space.set()  # it left the queue: read more
        if self._dispatcher is not None:
            self._dispatcher.answered(meta, call)
            if meta.started_unix:
                self._dispatcher.ran(meta.started_unix)
        record = finished(meta, call, self._model, self._worker_id)
        enqueued_ms = meta.request.get("ts")
        if meta.started_unix and enqueued_ms:
            waited = max(0.0, meta.started_unix - enqueued_ms / 1e3)
            self._metrics.waited(request_tenant(meta.request), waited)
        if self._trace is not None:
            generation = self._generation is not None and call.error is None
            self._trace.answered(record, meta, call.results if generation else None)
        self.answer(record)

    def refuse(
        self, sidx: int, entry: bytes, raw: dict[bytes, bytes], kind: str, reason: str
    ) -> None:
        """Dead-letter one entry (unread: too large; or delivered too often)."""
        self.answer(dead_letter(sidx, entry, raw, kind, reason, worker_id=self._worker_id))

    def answer(self, record: Record, meta: Meta | None = None) -> None:
        """Count ``record`` and put it out with the writer's next write."""
        if self._trace is not None and (meta is not None or record.dead is not None):
            self._trace.answered(record, meta)
        self._counts[record.status] += 1
        self._metrics.result(record.status, record.account)
        self._answers.put(record)
