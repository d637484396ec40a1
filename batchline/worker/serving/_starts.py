"""The calls a worker holds as they start to run: their metadata stamped with when they start
and in what batch, and those whose producers cancelled them rejected before they run. The
executors (:mod:`._executors`) tell it which calls start."""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING

from batchline.drivers._base import Call, Item
from batchline.errors import RequestCancelled
from batchline.transport import CancelLog
from batchline.worker.shared._held import Claims

if TYPE_CHECKING:
    from batchline.tracing._otel import WorkerTrace

__all__ = ["Starts"]


class Starts:
    """The starts of one worker's calls.

    Args:
        claims: what the worker holds (the metadata of its calls).
        cancels: the queue's cancellations, as the worker follows them.
        space: set as a batch starts: room in the read-ahead window for the reader.
        trace: the worker's spans (None: tracing off): a batch's span starts here.
    """

    def __init__(
        self,
        claims: Claims,
        cancels: CancelLog,
        space: asyncio.Event,
        *,
        trace: WorkerTrace | None = None,
    ) -> None:
        self._meta = claims.calls
        self._cancels = cancels
        self._space = space
        self.trace = trace

    async def before_batch(self, batch: list[Item]) -> None:
        """A batch of the asyncio batcher starts (on the loop): its calls are marked, and
        those cancelled are rejected."""
        self._space.set()
        calls = list(dict.fromkeys(item.call for item in batch))
        self.started(calls, len(batch))
        if self.trace is not None:
            self.trace.batch_started(batch, [self._meta.get(call) for call in calls])
        if not self._cancels:
            return
        for call in calls:
            if self.cancelled(call):
                call.reject(
                    RequestCancelled("cancelled by its producer before a worker started it")
                )

    def started(self, calls: list[Call], batch_size: int) -> None:
        """These calls start, in a batch of ``batch_size`` (any thread: plain writes)."""
        now = time.time()
        for call in calls:
            meta = self._meta.get(call)
            if meta is not None:
                meta.started_unix = now
                meta.batch_size = batch_size

    def admitted(self, calls: list[Call], rows: int) -> None:
        """A generation step admits these calls, its batch now ``rows`` sequences (on the
        model thread): they are marked, and the step's batch span starts (tracing on)."""
        self.started(calls, rows)
        if self.trace is not None:
            self.trace.admitted([self._meta.get(call) for call in calls], rows)

    def step_ended(self) -> None:
        """The generation step under way ended (its batch span too)."""
        if self.trace is not None:
            self.trace.step_ended()

    def cancelled(self, call: Call) -> bool:
        """Whether the producer of ``call`` cancelled it."""
        meta = self._meta.get(call) if self._cancels else None
        if meta is None:
            return False
        request = meta.request
        return self._cancels.covers(
            request["id"], meta.entry, request.get("ts") or math.inf, request.get("ca")
        )
