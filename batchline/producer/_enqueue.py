"""The way in: concurrent submits coalesced into one call of the enqueue script per write.

A write goes as soon as the previous one is back, carrying everything that arrived meanwhile
(up to ``submit_batch``); the script checks the queue depth and adds the entries atomically,
and says of each request what it did with it (see :func:`._replies.outcome_of`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import msgpack

from batchline.codec import Result
from batchline.config import ProducerSettings
from batchline.errors import (
    BatcherClosed,
    EnqueueUncertain,
    NotReplicated,
    QueueFull,
    ServiceUnavailable,
)
from batchline.producer._failures import Failed, connected, uncertain, writer_for
from batchline.producer._replies import Answered, Waiters, outcome_of
from batchline.redis_url import is_sentinel_url
from batchline.transport import (
    Admission,
    Outbox,
    RedisClient,
    Replication,
    once_keys,
    redis_failure,
    translate,
)

if TYPE_CHECKING:
    from batchline.tracing._otel import ProducerTrace

__all__ = ["Enqueuer", "Target"]

logger = logging.getLogger(__name__)

#: Who learns how a write went: a submit's ack future, or an infer's (request id, future).
Target = asyncio.Future[Any] | tuple[str, "asyncio.Future[Result] | None"]
#: A request in the outbox: its entry for the enqueue script, who learns the outcome, its id,
#: its tenant (None: untenanted).
_Pending = tuple[list[Any], Target, str, str | None]


class Enqueuer:
    """A producer's writes: requests wait in an outbox while a write is in flight; the next
    write takes them all, on a connection of its own (:func:`._failures.writer_for`).

    Args:
        redis: the producer's client.
        settings: the producer's settings.
        waiting: the producer's waiters (a failed write, or one answered at once, settles
            an ``infer``'s waiter).
        counts: submits by what the enqueue script did with them (queued, result, ...).
        admission: how the writes reach the queue (the functions or the script).
        name: the writing task's name.
        trace: the producer's spans (None: tracing off): each write's end ends its send spans.
    """

    def __init__(
        self,
        redis: RedisClient,
        settings: ProducerSettings,
        waiting: Waiters,
        counts: Counter[str],
        *,
        admission: Admission,
        name: str,
        trace: ProducerTrace | None = None,
    ) -> None:
        self.settings = settings
        self._trace = trace
        keys = settings.keys
        self._redis = redis
        # The writes' own connection (on a cluster with durability replicated, to the node
        # that holds the queue: WAIT counts the writes of its own connection).
        replicated = settings.durability == "replicated"
        self._writer = writer_for(redis, pin=keys.inbox if replicated else None)
        self._waiting = waiting
        self._counts = counts
        self._limits = settings.limits()
        self._admission = admission
        self._replication = Replication.of(settings)
        # Through Sentinel or on a cluster a lost connection is most likely a failover: a
        # write it cut (or refused, no primary yet) goes again, for up to redis_wait_s; the
        # same ids make that safe (a request queued by the first try is attached, not queued
        # twice).
        fails_over = settings.redis_cluster or is_sentinel_url(
            settings.redis_url.get_secret_value()
        )
        self._failover_s = settings.redis_wait_s if fails_over else 0
        self._keys = once_keys(keys)
        self._outbox: Outbox[_Pending] = Outbox(
            self._flush, max_batch=settings.submit_batch, abandon=self._abandon, name=name
        )
        self._writing: list[_Pending] = []  # the write in flight
        self._flushed = asyncio.Event()  # set (and replaced) as each write ends

    def put(self, entry: list[Any], target: Target, rid: str, tenant: str | None = None) -> None:
        """Queue one request's entry for the next write; ``target`` learns how it went."""
        self._outbox.put((entry, target, rid, tenant))

    async def drain(self) -> None:
        """Wait until the requests already put are written."""
        await self._outbox.drain()

    async def written(self, rid: str) -> None:
        """Wait until no request of ``rid`` already put waits to be written or is being
        written (a cancel is then admitted after them: docs/protocol.md, Attempts)."""
        while any(p[2] == rid for p in (*self._writing, *self._outbox)):
            # (rare: a cancel right after its request's submit) each write, and the end of
            # what will never be written, sets the event
            await self._flushed.wait()

    async def aclose(self) -> None:
        """Close the writes' own connection."""
        if self._writer is not self._redis:
            await self._writer.aclose()
            pool = getattr(self._writer, "connection_pool", None)
            if pool is not None:
                await pool.disconnect()  # its own pool (writer_for)

    def queue_full(self) -> QueueFull:
        keys = self.settings.keys
        return QueueFull(
            f"queue {keys.queue!r} holds max_queue_depth={self.settings.max_queue_depth} requests"
        )

    async def _flush(self, pending: list[_Pending]) -> None:
        """Write one batch of the outbox, one call per tenant in it (the untenanted one, in
        the common case); tell each submit how its write went."""
        self._writing = pending
        try:
            tenants = {tenant for *_, tenant in pending}
            if len(tenants) == 1:
                await self._flush_one(pending, tenants.pop())
                return
            for tenant in sorted(tenants, key=lambda t: t or ""):
                await self._flush_one([p for p in pending if p[3] == tenant], tenant)
        finally:
            self._writing = []
            self._wrote()

    def _wrote(self) -> None:
        """A write ended, or what waited will never be written: wake :meth:`written`."""
        self._flushed.set()
        self._flushed = asyncio.Event()

    async def _flush_one(self, pending: list[_Pending], tenant: str | None) -> None:
        # Higher priorities first (each priority in the order put): an interactive request
        # put after a burst of low ones is admitted ahead of them.
        pending = sorted(pending, key=lambda p: -p[0][0])
        try:
            entries = await self._write_through_failover(
                [e for e, *_ in pending], [p[2] for p in pending], tenant
            )
        except Failed as failed:  # each submit of this write gets its error
            for (_, target, rid, _t), error in zip(pending, failed.errors, strict=True):
                self._told(rid, target, error)
        except Exception as exc:
            for _, target, rid, _t in pending:
                self._told(rid, target, exc)
        else:
            for (sent, target, rid, _t), entry in zip(pending, entries, strict=True):
                if isinstance(entry, NotReplicated):
                    self._counts["not_replicated"] += 1
                    self._told(rid, target, entry)
                    continue
                outcome = outcome_of(rid, entry, self._limits, sent[1])
                self._counts[outcome.kind] += 1
                self._told(rid, target, outcome)

    def _abandon(self, pending: list[_Pending]) -> None:
        """The writes that will never go (the loop is closing)."""
        for _, target, rid, _t in pending:
            self._told(rid, target, BatcherClosed("the producer stopped writing"))
        self._wrote()

    def _told(self, rid: str, target: Target, outcome: Any) -> None:
        """:meth:`_settle`, after the request's send span (tracing on) learns the outcome."""
        if self._trace is not None:
            self._trace.written(rid, outcome)
        self._settle(target, outcome)

    def _settle(self, target: Target, outcome: Any) -> None:
        """Tell a submit how its write went: ``submit`` awaits the script's answer (an ack
        future); ``infer`` awaits only its result, so only a failed write, or an answer that
        settles it at once (a stored or cached result, a conflict), resolves that one."""
        if isinstance(target, asyncio.Future):
            if not target.done():
                if isinstance(outcome, BaseException):
                    target.set_exception(outcome)
                else:
                    target.set_result(outcome)
            return
        rid, fut = target
        if isinstance(outcome, Answered):
            if outcome.kind == "full":
                outcome = self.queue_full()
            elif outcome.now is None:
                return  # queued, attached or coalesced: the answer will be pushed
            else:
                outcome = outcome.now
        if isinstance(outcome, BaseException | Result):
            self._waiting.drop(rid, fut)
            if fut is not None and not fut.done():
                if isinstance(outcome, Result):
                    fut.set_result(outcome)
                else:
                    fut.set_exception(outcome)
                    fut.exception()  # retrieved: its caller may have gone

    async def _write_through_failover(
        self, batch: list[list[Any]], ids: list[str], tenant: str | None = None
    ) -> list[Any]:
        """:meth:`_write`, again after a lost connection or no primary, for up to
        ``_failover_s`` (0: once)."""
        deadline = time.monotonic() + self._failover_s
        delay_s = 0.1
        while True:
            try:
                return await self._write(batch, ids, tenant)
            except Failed as failed:
                again = all(
                    isinstance(e, EnqueueUncertain | ServiceUnavailable)
                    and not isinstance(e, NotReplicated)
                    for e in failed.errors
                )
                if not again or time.monotonic() + delay_s > deadline:
                    raise
                logger.warning(
                    "a write of %d requests failed (%s): again in %.1f s, the same ids",
                    len(ids),
                    failed.errors[0],
                    delay_s,
                )
            await asyncio.sleep(delay_s)  # a back-off while a failover completes
            delay_s = min(delay_s * 2, 2.0)

    async def _write(
        self, batch: list[list[Any]], ids: list[str], tenant: str | None = None
    ) -> list[Any]:
        """One call of the enqueue script; raises Failed with a typed error per request."""
        flat: list[Any] = []  # one after another: the script makes no table per request
        for priority, fields in batch:
            flat.append(priority)
            flat.append(len(fields))
            flat += fields
        payload = msgpack.packb(flat, use_bin_type=False)
        s = self.settings
        args = [s.max_queue_depth, payload, s.result_ttl_s, s.cache_ttl_s, *self._keys]
        try:
            # Connected first, so that a failure to connect (nothing sent) is told apart
            # from one with the write in flight.
            await connected(self._writer)
        except Exception as caught:
            exc = redis_failure(caught)
            if exc is None:
                raise
            raise Failed([translate(exc) for _ in ids], exc) from caught
        try:
            # Sizes are the workers' to check (their limits): the admission refuses an entry
            # larger than their largest request.
            replies = await self._admission.enqueue(self._writer, args, max_bytes=0, tenant=tenant)
            if not self._replication.replicated:
                return replies
            confirmed = await self._replication.confirmed(self._writer)
        except Exception as caught:
            exc = redis_failure(caught)
            if exc is None:
                raise
            raise Failed([uncertain(exc, rid) for rid in ids], exc) from caught
        if self._replication.short(confirmed):
            r = self._replication
            # What was written is not accepted; what was answered at once stands.
            replies = [
                NotReplicated(rid, confirmed, r.needed, r.timeout_ms) if _written(reply) else reply
                for rid, reply in zip(ids, replies, strict=True)
            ]
        return replies


def _written(reply: Any) -> bool:
    """Whether the enqueue function (or script) wrote this request: queued (an entry id or
    ``"queued"``), attached or coalesced; not answered at once, refused or full."""
    if reply is None or reply is False:
        return False
    if not isinstance(reply, list):
        return True
    kind = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
    return kind in ("attached", "coalesced")
