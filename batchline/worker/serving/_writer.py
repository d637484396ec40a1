"""The worker's writer: answers go out in one call of the completion script per write.

Answers wait in an :class:`~batchline.transport._outbox.Outbox` while a write is in flight; the next
write takes them all. The script acknowledges each entry and, only if the acknowledgement
took, writes its result (with its TTL) and pushes the replies, then deletes the entries
(``docs/protocol.md``). A write rides out a Redis restart (:meth:`Backoff.retry
<batchline.transport._redis.Backoff.retry>`); past its budget the entries stay pending, go idle and
are reclaimed and answered later, so nothing is lost either way.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgpack

from batchline.keys import GROUP, QueueKeys
from batchline.transport import (
    COMPLETE,
    Backoff,
    Outbox,
    RedisClient,
    Replication,
    Script,
    redis_failure,
)
from batchline.worker.serving._cache import AnswerCache
from batchline.worker.shared._held import Claims, Record

__all__ = ["AnswerWriter"]

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
    ) -> None:
        self._client = client
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

    def put(self, record: Record) -> None:
        """Write ``record`` with the next write (on the running event loop)."""
        self._outbox.put(record)

    async def drain(self) -> None:
        """Return once every record put so far is written (or given up)."""
        await self._outbox.drain()

    async def _flush(self, records: list[Record]) -> None:
        try:
            await self._write(records)
        except Exception as caught:
            exc = redis_failure(caught)
            if exc is None:
                raise
            # Unanswered entries stay pending; no longer kept alive by this worker, they go
            # idle and are reclaimed and answered later.
            logger.error("writer: %d answers not written: %s", len(records), exc)
        self._claims.settle(records)

    def _record(self, r: Record) -> list[Any]:
        """One record as the completion script takes it (see ``COMPLETE``): five fields,
        then how many more follow (a plain answer: none) and those."""
        if r.result is None or r.request_id is None:
            out: list[Any] = [r.sidx, r.entry, "", "", ""]
        else:
            out = [r.sidx, r.entry, r.request_id, r.reply or "", r.result]
        cache, mark = self._cache.keys_for(r) if self._cache is not None else ("", "")
        status = "cut" if r.cut else r.status
        if r.dead:
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
        tries = 0

        async def attempt() -> None:
            # Again after a failure: the first try may have written on a primary that died
            # before its push reached the producers.
            nonlocal tries
            tries += 1
            done = await self._script(self._client, keys, [*args, "1" if tries > 1 else "0"])
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
