"""The worker's side of the fair share (docs/protocol.md, Tenants: the fair share).

The admit function holds tenants' requests in backlogs and dispatches them into the work
streams, least virtual start first, while a stream holds fewer than ``ahead`` undelivered
entries (:mod:`batchline.transport._fair`). The order is decided as late as it can be: at
the moment a worker reads. While the backlogs hold anything (as the last admit or dispatch
call said; every worker's admitter calls the admit function at least once a second), or
tenants' requests came lately, the reader sends :meth:`Dispatcher.call` with each read, in
one round trip (the call first), which fills the streams with just what the worker is about
to read (one call of the dispatch function per read, none per request). The admit function
itself fills a stream only to ``admit_ahead``: one entry per live worker (at most a batch),
enough to wake the workers that wait on an empty stream, and no more, so that a tenant whose
request comes while the workers are busy goes into the next batch formed, not behind entries
dispatched before it came. The call carries the corrections gathered since the last one: for each
tenant and priority, the real cost of its requests answered (generation: prompt and
generated tokens; otherwise items) less the producer's estimate (``cost``).

While anything is held, a worker reads only while its model is free (its window: one batch,
and none while a batch runs), so that the batch it forms next is made of what was
dispatched last; for a while after it last read a tenant's request it holds at most one
batch waiting ahead of its model (its ``read_ahead`` window applies otherwise: untenanted
traffic alone is served as without tenants). Continuous batching (generation) keeps its own
window (two batches' worth, running sequences included) and admits new sequences in the
order read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from redis.exceptions import ResponseError

from batchline.config import WorkerSettings
from batchline.drivers._base import Call
from batchline.transport import DISPATCH, fair_args, function_missing, redis_failure
from batchline.worker.shared._held import Entry, Meta

__all__ = ["AHEAD_AT", "Dispatcher", "real_cost"]

logger = logging.getLogger(__name__)

#: Where ``ahead`` is in the fair share's block of arguments (:func:`fair_args`).
AHEAD_AT = 1

#: The weight of the latest figure in the smoothed times of calls and reads.
SMOOTHING = 0.2

#: A read's time counted at most (one that waited on a slow Redis is not the usual).
MAX_READ_S = 0.05

#: How long after the last tenant's entry it read a worker keeps its window at one batch.
TENANTS_SEEN_S = 10.0


def real_cost(call: Call) -> int:
    """What one answered request cost, in the unit of its estimate: a generation's prompt
    and generated tokens; otherwise its items."""
    results = call.results
    first = results[0] if results else None
    prompt = getattr(first, "prompt_tokens", None)
    if isinstance(prompt, int):
        return prompt + len(getattr(first, "token_ids", ()))
    return call.size


class Dispatcher:
    """Refills the work streams from the fair share's backlogs; see the module docstring.

    Args:
        settings: the worker's settings (its queue, ``batch_size``, ``fair_share``).
        generation: whether the worker serves a generation model (its window is bounded by
            the executor already).

    Attributes:
        held: requests the backlogs hold, as the last admit or dispatch call said.
        calls: calls of the dispatch function made.
    """

    def __init__(self, settings: WorkerSettings, *, generation: bool = False) -> None:
        keys = settings.keys
        self._batch = settings.batch_size
        self._generation = generation
        self._streams = keys.streams_low_first
        #: The fair share's block of the admit and dispatch functions' arguments (its
        #: ``ahead``, at AHEAD_AT, is set per call).
        self.args = fair_args(
            keys, ahead=1, on=settings.fair_share, result_ttl_s=settings.result_ttl_s
        )
        self._live = 1
        self._run_s: float | None = None  # how long calls ran lately (smoothed)
        self._read_s = 0.0  # how long a read took lately, dispatch included (smoothed)
        self._read_began = 0.0
        self._base = keys.base_prefix
        self.held = 0
        self.calls = 0
        self._tenants_until = 0.0
        self._corrections: dict[tuple[str, int], int] = {}
        self._sent: dict[tuple[str, int], int] = {}  # the corrections of the call in flight

    @property
    def admit_ahead(self) -> int:
        """The admit function's ``ahead``: an entry per live worker, at most a batch."""
        return max(1, min(self._batch, self._live))

    def live(self, workers: int) -> None:
        """Note how many workers serve the queue (as the heartbeat counts them)."""
        self._live = workers

    def window(self, window: int, *, since: Callable[[], float | None]) -> tuple[int, float]:
        """The entries the worker may hold ahead of its model, given its own ``window`` and
        when the batch under way started (``since()``: unix seconds, None: the model is
        free); and, where that is none for now, in how many seconds it opens (else 0).

        While requests are held: one batch while the model is free, or in the last moments
        of the batch under way (its expected time, as batches ran lately, less twice the
        time a read takes: the next batch is read as this one ends, not before), else none.
        One batch while tenants' requests came lately (within TENANTS_SEEN_S of the last
        read that brought one)."""
        if self._generation:
            return window, 0.0
        if self.held:
            started = since()
            if started is None:
                return min(window, self._batch), 0.0
            if self._run_s is None:  # no call ran yet: read once the model is free
                return 0, 0.0
            opens = started + self._run_s - 2 * self._read_s - time.time()
            return (0, opens) if opens > 0 else (min(window, self._batch), 0.0)
        if self._tenants_lately():
            return min(window, self._batch), 0.0
        return window, 0.0

    def ran(self, started_unix: float) -> None:
        """Note how long one call ran (from its batch's start until it was answered)."""
        took = time.time() - started_unix
        last = self._run_s
        self._run_s = took if last is None else last + (took - last) * SMOOTHING

    def _tenants_lately(self) -> bool:
        return time.monotonic() < self._tenants_until

    def read(self, entries: Iterable[Entry]) -> None:
        """Note the entries of one read: whether any is a tenant's (its ``tn`` field), and
        how long the read took since :meth:`call` (it did not wait)."""
        if self._read_began:
            took, self._read_began = time.monotonic() - self._read_began, 0.0
            self._read_s += (min(took, MAX_READ_S) - self._read_s) * SMOOTHING
        if any(raw and b"tn" in raw for _sidx, _entry, raw in entries):
            self._tenants_until = time.monotonic() + TENANTS_SEEN_S

    def answered(self, meta: Meta, call: Call) -> None:
        """Note the real cost of one request answered, against its estimate, while the
        backlogs hold anything. With nothing held no tenant is backlogged: a correction
        would only move an idle tenant's last finish, mostly behind the clock already; kept
        until the next dispatch call, when something is held again, it would charge (or
        refund) a backlog formed since for work done before it. So it is dropped, with
        those gathered and not sent."""
        if not self.held:
            self._corrections.clear()
            return
        if call.error is not None:
            return
        request: Any = meta.request
        estimate = request.get("cost")
        if estimate is None and request.get("tenant") is None:
            return  # untenanted and no estimate: nothing to correct
        delta = real_cost(call) - min(1_000_000, max(1, int(estimate or 1)))
        if delta:
            key = (request.get("tenant") or "-", meta.sidx)
            self._corrections[key] = self._corrections.get(key, 0) + delta

    def call(self, room: int) -> list[Any] | None:
        """The dispatch function's call (``FCALL`` and its arguments) to send with a read of
        up to ``room`` entries a stream, filling each stream to ``room`` undelivered entries;
        None where no call is needed (the backlogs hold nothing, no tenant's request came
        lately). Its outcome goes to :meth:`called`, or :meth:`lost`."""
        if not (self.held or self._tenants_lately()):
            return None
        self._read_began = time.monotonic()
        args = list(self.args)
        args[AHEAD_AT] = max(1, room)
        self._restore(self._sent)  # (none: each call is told called() or lost() first)
        self._sent, self._corrections = self._corrections, {}
        flat: list[Any] = []
        for (tenant, priority), delta in self._sent.items():
            flat += (tenant, priority, delta)
        return [DISPATCH, len(self._streams), *self._streams, self._base, *args, *flat]

    def called(self, outcome: Any) -> bool:
        """Note the outcome of the call :meth:`call` made: the backlogs' count, or the error
        it answered (the function missing: the admitter loads it again; Redis failing is
        left to the next read, the admitter dispatching at least once a second meanwhile).
        Returns whether the read may wait for entries: not while the backlogs still hold
        any (the streams hold what it may take, and a read that waited could bring in,
        while a batch runs, an entry the admission dispatches)."""
        sent, self._sent = self._sent, {}
        if isinstance(outcome, BaseException):
            if isinstance(outcome, ResponseError):
                if not function_missing(outcome):
                    logger.warning("dispatch: %s", outcome)
            else:
                failure = redis_failure(outcome)
                if failure is None:
                    raise outcome
                logger.debug("dispatch: %s", failure)
            self._restore(sent)
            return True
        self.calls += 1
        self.held = int(outcome)
        if not self.held:
            self._read_began = 0.0  # the read may wait: not a read's time
        return not self.held

    def lost(self) -> None:
        """The call :meth:`call` made was not answered (the connection failed): its
        corrections go with the next."""
        sent, self._sent = self._sent, {}
        self._restore(sent)

    def _restore(self, corrections: dict[tuple[str, int], int]) -> None:
        for key, delta in corrections.items():
            self._corrections[key] = self._corrections.get(key, 0) + delta
