"""The worker's side of the fair share (docs/protocol.md, Tenants: the fair share).

The admit function holds tenants' requests in backlogs and dispatches them into the work
streams, least virtual start first, while a stream holds fewer than ``ahead`` undelivered
entries (:mod:`batchline.transport._fair`). So that the streams refill as workers take
entries, and not only when the next inbox element comes, the reader calls
:meth:`Dispatcher.after_read` after each read that took entries: while the backlogs hold
anything (as the last admit or dispatch call said; every worker's admitter calls the admit
function at least once a second), that is one call of the dispatch function per read, none
per request; with nothing held, none at all. The call carries the corrections gathered since
the last one: for each tenant and priority, the real cost of its requests answered
(generation: prompt and generated tokens; otherwise items) less the producer's estimate
(``cost``).

While anything is held, and for a while after it last read a tenant's request, the worker
also holds at most one batch waiting ahead of its model (its ``read_ahead`` window applies
otherwise: untenanted traffic alone is served as without tenants), so that what it read is
taken in the order dispatched: a tenant that becomes backlogged waits behind about two
batches (the stream's ``ahead``) and the one running, not behind a whole read-ahead window
of another tenant's. Continuous batching (generation) holds two batches' worth, running
sequences included, and admits new sequences in the order read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from redis.exceptions import ResponseError

from batchline.config import WorkerSettings
from batchline.drivers._base import Call
from batchline.transport import DISPATCH, RedisClient, fair_args, function_missing, redis_failure
from batchline.worker.shared._held import Entry, Meta

__all__ = ["Dispatcher", "real_cost"]

logger = logging.getLogger(__name__)

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
        ahead: undelivered entries a work stream is filled to: two batches.
        held: requests the backlogs hold, as the last admit or dispatch call said.
        calls: calls of the dispatch function made.
    """

    def __init__(self, settings: WorkerSettings, *, generation: bool = False) -> None:
        keys = settings.keys
        self.ahead = 2 * settings.batch_size
        self._batch = settings.batch_size
        self._generation = generation
        self._streams = keys.streams_low_first
        #: The fair share's block of the admit and dispatch functions' arguments.
        self.args = fair_args(
            keys, ahead=self.ahead, on=settings.fair_share, result_ttl_s=settings.result_ttl_s
        )
        self._base = keys.base_prefix
        self.held = 0
        self.calls = 0
        self._tenants_until = 0.0
        self._corrections: dict[tuple[str, int], int] = {}

    def window(self, window: int) -> int:
        """The entries the worker may hold ahead of its model, given its own ``window``: one
        batch while requests are held or tenants' requests came lately (within
        TENANTS_SEEN_S of the last read that brought one)."""
        if self._generation:
            return window
        if self.held or time.monotonic() < self._tenants_until:
            return min(window, self._batch)
        return window

    def read(self, entries: Iterable[Entry]) -> None:
        """Note the entries of one read: whether any is a tenant's (its ``tn`` field)."""
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

    async def after_read(self, client: RedisClient) -> None:
        """After a read that took entries: one call of the dispatch function, while the
        backlogs hold anything; Redis failing is left to the next read (the admitter
        dispatches at least once a second meanwhile)."""
        if not self.held:
            return
        corrections, self._corrections = self._corrections, {}
        flat: list[Any] = []
        for (tenant, priority), delta in corrections.items():
            flat += (tenant, priority, delta)
        try:
            held = await client.fcall(
                DISPATCH, len(self._streams), *self._streams, self._base, *self.args, *flat
            )
        except ResponseError as exc:
            if not function_missing(exc):  # missing: the admitter loads it again
                logger.warning("dispatch: %s", exc)
            self._restore(corrections)
            return
        except Exception as caught:
            failure = redis_failure(caught)
            if failure is None:
                raise
            logger.debug("dispatch: %s", failure)
            self._restore(corrections)
            return
        self.calls += 1
        self.held = int(held)

    def _restore(self, corrections: dict[tuple[str, int], int]) -> None:
        for key, delta in corrections.items():
            self._corrections[key] = self._corrections.get(key, 0) + delta
