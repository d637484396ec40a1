"""The worker's writer: answers go out in one call of the completion script per write.

Answers wait in an :class:`~batchline.transport._outbox.Outbox` while a write is in flight; the next
write takes them all. The script acknowledges each entry and, only if the acknowledgement
took, writes its result (with its TTL) and pushes the replies, then deletes the entries
(``docs/protocol.md``). A write rides out a Redis restart (:meth:`Backoff.retry
<batchline.transport._redis.Backoff.retry>`); past its budget the entries stay pending, go idle and
are reclaimed and answered later, so nothing is lost either way.

Each answer also carries the worker's part in answers computed once (:class:`AnswerCache`):
which cache key the completion script may fill and which in-flight mark it clears. The cache
hash of an entry (field ``ck``, added by the enqueue script) is trusted only once recomputed
here from the entry's own ``meta`` and ``blob`` (the record's input hash:
:func:`~batchline.worker.serving._answers.answer`, ``dead_letter``) and this worker's model
identity, which it publishes (:func:`model_identity`, part of every cache hash): a producer
may add entries directly, and a worker that serves another model (a rolling model upgrade)
must not fill the cache under the old model's hash. Where it matches, an ok result fills the
cache key; either way the in-flight mark is cleared (the script clears it only while it
names this request), and the input hash lets the script check each request coalesced onto
this one (docs/protocol.md, Answers computed once).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import msgpack

from batchline.config import WorkerSettings
from batchline.keys import GROUP, QueueKeys
from batchline.transport import (
    COMPLETE,
    USAGE_TTL_DAYS,
    Backoff,
    Outbox,
    RedisClient,
    Replication,
    Script,
    cache_hash,
    once_figures,
    quota_args,
    redis_failure,
)
from batchline.worker.metrics import Metrics
from batchline.worker.shared._held import Claims, Record

__all__ = ["AnswerCache", "AnswerWriter", "model_identity"]

logger = logging.getLogger(__name__)

REPLY_MAXLEN = 100_000
_ASYNC = Replication()
DEAD_MAXLEN = 100_000
#: How long one write is retried through a Redis restart before its entries are left pending.
_RETRY_BUDGET_S = 30.0


class AnswerWriter:
    """Writes a worker's answers; the entries written (or given up) leave its ``claims``.

    Args:
        client: the writer's own client (a dedicated connection).
        keys: the queue's keys.
        result_ttl_s: how long a result key lives.
        claims: the entries the worker holds.
        usage_ttl_days: how long a day's usage counters are kept.
    """

    def __init__(
        self,
        client: RedisClient,
        keys: QueueKeys,
        *,
        result_ttl_s: int,
        claims: Claims,
        cache: AnswerCache | None = None,
        replication: Replication = _ASYNC,
        usage_ttl_days: int = USAGE_TTL_DAYS,
    ) -> None:
        self._client = client
        self._usage_ttl_s = usage_ttl_days * 86400
        self._cache = cache
        self._keys = keys
        self._result_ttl_s = result_ttl_s
        self._claims = claims
        self._script = Script(COMPLETE)
        self._replication = replication
        #: Answers pushed without the replicas' confirmation (durability replicated).
        self.unconfirmed = 0
        self._retry = Backoff(logger, "writer", max_delay_s=1.0)
        self._outbox: Outbox[Record] = Outbox(self._flush, name="batchline-writer")
        #: Set once a write failed with an error of the writer's own (not Redis's):
        #: :meth:`watch` raises it, which stops the worker.
        self._broken: asyncio.Future[None] | None = None

    def put(self, record: Record) -> None:
        """Write ``record`` with the next write (on the running event loop)."""
        self._outbox.put(record)

    async def drain(self) -> None:
        """Return once every record put so far is written (or given up)."""
        await self._outbox.drain()

    async def watch(self) -> None:
        """Until a write fails with an error of the writer's own (a bug, not Redis
        failing): then raise it, a task of the worker's that stops it (its supervisor starts
        a fresh one; the answers not written stay pending, reclaimed and answered later)."""
        if self._broken is None:
            self._broken = asyncio.get_running_loop().create_future()
        await self._broken

    async def _flush(self, records: list[Record]) -> None:
        try:
            await self._write(records)
        except Exception as caught:
            exc = redis_failure(caught)
            if exc is None:  # the writer's own: the worker stops (watch)
                if self._broken is not None and not self._broken.done():
                    self._broken.set_exception(caught)
                else:
                    logger.error("writer: %d answers not written", len(records), exc_info=caught)
            else:
                logger.error("writer: %d answers not written: %s", len(records), exc)
            # Unanswered entries stay pending; no longer kept alive by this worker, they go
            # idle and are reclaimed and answered later.
        self._claims.settle(records)

    def _record(self, r: Record) -> list[Any]:
        """One record as the completion script takes it (see ``COMPLETE``): five fields,
        then how many more follow (a plain answer: none; what it accounts: six) and those."""
        if r.result is None or r.request_id is None:
            out: list[Any] = [r.sidx, r.entry, "", "", ""]
        else:
            out = [r.sidx, r.entry, r.request_id, r.reply or "", r.result]
        cache, mark = self._cache.keys_for(r) if self._cache is not None else ("", "")
        status = "cut" if r.cut else r.status
        if r.account is not None and r.result is not None:
            out += (6, r.input_hash, cache, mark, status, r.dead or [], r.account)
        elif r.dead:
            out += (5, r.input_hash, cache, mark, status, r.dead)
        elif cache or mark or r.cut:
            out += (4, r.input_hash, cache, mark, status)
        elif r.input_hash:
            out += (1, r.input_hash)
        else:
            out.append(0)
        return out

    async def _write(self, records: list[Record]) -> None:
        packed = [field for r in records for field in self._record(r)]
        keys = [*self._keys.streams_low_first, self._keys.dead]
        args = [
            GROUP,
            self._result_ttl_s,
            REPLY_MAXLEN,
            DEAD_MAXLEN,
            self._keys.result_prefix,
            self._keys.reply_prefix,
            msgpack.packb(packed, use_bin_type=False),
            self._keys.request_input(""),
            self._keys.waiters(""),
            self._cache.ttl_s if self._cache is not None else 0,
            int(time.time() * 1e3),
            "1" if self._replication.replicated else "0",
        ]
        # After the try's own argument: where the accounting goes (docs/protocol.md, Tenants).
        usage, base = quota_args(self._keys, time.time())
        accounting = [usage, self._usage_ttl_s, base]
        tries = 0

        async def attempt() -> None:
            # Again after a failure: the first try may have written on a primary that died
            # before its push reached the producers.
            nonlocal tries
            tries += 1
            again = "1" if tries > 1 else "0"
            done = await self._script(self._client, keys, [*args, again, *accounting])
            if self._replication.replicated:
                await self._confirm_then_push(len(records), done[1])

        await self._retry.retry(attempt, budget_s=_RETRY_BUDGET_S)

    async def _confirm_then_push(self, n: int, replies: list[Any]) -> None:
        """Durability replicated: push the answers once the replicas hold them (WAIT on this
        connection, which wrote them); pushed all the same if they do not in time (the
        answer is computed; the primary holds it), with a warning."""
        confirmed = await self._replication.confirmed(self._client)
        if self._replication.short(confirmed):
            self.unconfirmed += n
            logger.warning(
                "writer: the answers of %d requests are held by the primary and %d replicas, "
                "not the %d required (min_replicas), after %d ms: pushed all the same",
                n,
                confirmed,
                self._replication.needed,
                self._replication.timeout_ms,
            )
        async with self._client.pipeline(transaction=False) as pipe:
            for key, count, packed in zip(replies[::3], replies[1::3], replies[2::3], strict=True):
                pipe.xadd(key, {"n": count, "r": packed}, maxlen=REPLY_MAXLEN, approximate=True)
                pipe.expire(key, self._result_ttl_s)
            await pipe.execute()


def model_identity(settings: WorkerSettings, model: object | None) -> str:
    """The ``model_id`` setting, else the model's class (a model object given to the
    worker), else the model spec and path with the backend and dtype that change its
    numerics, and ``deterministic`` where it is on (its answers do not depend on the batch:
    one from a worker without it is not one of its own): workers that would answer
    differently never share cached answers."""
    if settings.model_id:
        return settings.model_id
    if model is not None:
        return f"{type(model).__module__}.{type(model).__qualname__}"
    parts = [settings.model, settings.model_path or "", settings.backend, settings.dtype]
    if settings.deterministic:
        parts.append("deterministic")
    return "|".join(parts)


class AnswerCache:
    """What one worker publishes and marks for the cache (``cache_ttl_s > 0``)."""

    def __init__(self, settings: WorkerSettings, model: object | None) -> None:
        self.keys = settings.keys
        self.ttl_s = settings.cache_ttl_s
        self.model_id = model_identity(settings, model)
        # The identity lives as long as a worker renews it (heartbeats): with no worker
        # left, producers queue requests without cache hashes.
        self._model_ttl_s = max(5, math.ceil(3 * settings.heartbeat_s))

    async def publish(self, client: RedisClient) -> None:
        """Name this worker's model for the producers' cache hashes (cache on only)."""
        if self.ttl_s <= 0:
            return
        try:
            await client.set(self.keys.model, self.model_id, ex=self._model_ttl_s)
        except Exception as caught:  # the cache stays off until the next worker
            exc = redis_failure(caught)
            if exc is None:
                raise
            logger.warning("could not publish the model identity: %s", exc)

    async def beat(self, client: RedisClient, metrics: Metrics) -> None:
        """With each heartbeat: renew the model identity, export the queue's counters."""
        await self.publish(client)
        if metrics.port:
            try:
                metrics.once(once_figures(await client.hgetall(self.keys.once_stats)))
            except Exception as caught:
                exc = redis_failure(caught)
                if exc is None:
                    raise
                logger.warning("could not read the queue's counters: %s", exc)

    def keys_for(self, record: Record) -> tuple[str, str]:
        """The cache key the record's result may fill (its cache hash, if that is this
        worker's for the input it ran) and the in-flight mark to clear; empty where none."""
        if not record.cache_hash:
            return "", ""
        ours = cache_hash(self.model_id, record.input_hash, record.tenant)
        mine = self.ttl_s > 0 and ours == record.cache_hash
        cache = self.keys.cache(record.cache_hash) if mine else ""
        return cache, self.keys.in_flight(record.cache_hash)
