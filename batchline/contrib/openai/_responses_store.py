"""Stored responses in Redis (:class:`ResponseStore`), shared by every API replica.

A stored response is a hash (its request, the generation request's id, its owner) and a
stream of its events, under the ``{responses}`` hash tag (:class:`batchline.keys.ResponsesKeys`),
both expiring ``responses_ttl_s`` after its creation. Event ``n`` has the stream id
``<n+1>-0``, appended with ``XADD <id> NOMKSTREAM``: an append whose number another writer
took already fails (Redis refuses an id not above the stream's last), so that two writers
(the replica running the response, another finishing it after that one died) never write
one number twice, and the log is the one account every reader resumes from. ``NOMKSTREAM``:
a deleted response is not brought back by a late append.

Each tenant keeps at most ``responses_max`` stored responses (the untenanted API: in all);
a create past the bound evicts that tenant's oldest.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from batchline.contrib.openai._responses_schema import FINAL_EVENTS, PREFIX_EVENTS, encode, tally
from batchline.keys import ResponsesKeys
from batchline.transport import RedisClient
from batchline.transport import block_ms as bounded

__all__ = ["Log", "ResponseStore"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Log:
    """What a response's event log holds: the next event's number, the text of its
    deltas, how many events of its ending are in (after the deltas), whether it ended,
    and the last event (the ending's ``response`` is the final object)."""

    next: int
    text: str
    ending: int
    ended: bool
    last: dict[str, Any] | None


def _entries(raw: list[Any]) -> list[tuple[int, bytes]]:
    out = []
    for entry_id, fields in raw:
        seq = int(entry_id.split(b"-")[0]) - 1
        out.append((seq, fields[b"e"]))
    return out


class ResponseStore:
    """Stored responses and their event logs.

    Args:
        redis: the app's client.
        keys: the key names.
        ttl_s: how long a response is kept after its creation.
        max_count: most stored responses per tenant.
    """

    def __init__(
        self, redis: RedisClient, keys: ResponsesKeys, *, ttl_s: int, max_count: int
    ) -> None:
        self.redis, self.keys, self.ttl_s, self.max_count = redis, keys, ttl_s, max_count

    async def create(self, record: dict[str, Any], first: dict[str, Any]) -> None:
        """Store a new response's ``record`` and its first event (number 0); evict its
        tenant's oldest past the bound."""
        rid, tenant = record["id"], record.get("tenant")
        index = self.keys.index(tenant)
        now = time.time()
        fields = {k: json.dumps(v) for k, v in record.items()}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.response(rid), mapping=fields)
            pipe.expire(self.keys.response(rid), self.ttl_s)
            pipe.xadd(self.keys.events(rid), {"e": encode(first, 0)}, id="1-0")
            pipe.expire(self.keys.events(rid), self.ttl_s)
            pipe.zremrangebyscore(index, "-inf", now - self.ttl_s)
            pipe.zadd(index, {rid: now})
            await pipe.execute()
        evicted = await self.redis.zrange(index, 0, -(self.max_count + 1))
        if evicted:
            logger.info(
                "responses: %d stored responses evicted (responses_max=%d)",
                len(evicted),
                self.max_count,
            )
            for old in evicted:
                await self.delete(old.decode(), tenant)

    async def load(self, response_id: str) -> dict[str, Any] | None:
        """A response's record, or None."""
        raw = await self.redis.hgetall(self.keys.response(response_id))
        if not raw or b"id" not in raw:
            return None
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    async def mark_cancelled(self, response_id: str) -> None:
        """Note that the response was cancelled (its ending says ``cancelled``)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.response(response_id), mapping={"cancelled": "true"})
            pipe.expire(self.keys.response(response_id), self.ttl_s)  # (a gone one: no id)
            await pipe.execute()

    async def delete(self, response_id: str, tenant: str | None) -> bool:
        """Delete a response (whether it was there)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.response(response_id), self.keys.events(response_id))
            pipe.zrem(self.keys.index(tenant), response_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def log(self, response_id: str, prefix_count: int = PREFIX_EVENTS) -> Log:
        """The response's log as it is now (``prefix_count``: its events before any
        output, :class:`~batchline.contrib.openai._responses_schema.Events`' count)."""
        raw = await self.redis.xrange(self.keys.events(response_id))
        text, ending, last = [], 0, None
        for seq, data in _entries(raw):
            last = json.loads(data)
            ending, more = tally(ending, seq, last, prefix_count)
            text.append(more)
        ended = last is not None and last["type"] in FINAL_EVENTS
        return Log(len(raw), "".join(text), ending, ended, last)

    async def events(self, response_id: str, after: int) -> list[tuple[int, bytes]]:
        """The events numbered above ``after``, as stored."""
        raw = await self.redis.xrange(self.keys.events(response_id), min=f"{after + 2}-0")
        return _entries(raw)

    async def wait_events(
        self, response_id: str, after: int, block_ms: int
    ) -> list[tuple[int, bytes]]:
        """The events numbered above ``after``, waiting up to ``block_ms`` for one
        (``XREAD BLOCK``: woken by the append)."""
        key = self.keys.events(response_id)
        got = await self.redis.xread({key: f"{after + 1}-0"}, block=bounded(self.redis, block_ms))
        return _entries(got[0][1]) if got else []

    async def append(self, response_id: str, start: int, events: list[dict[str, Any]]) -> bool:
        """Append ``events`` numbered from ``start``, one at a time; False once one's
        number is taken (another writer's), or the response is gone."""
        key = self.keys.events(response_id)
        for n, event in enumerate(events, start):
            try:
                added = await self.redis.xadd(
                    key, {"e": encode(event, n)}, id=f"{n + 1}-0", nomkstream=True
                )
            except ResponseError as exc:
                if "equal or smaller" not in str(exc):
                    raise
                return False
            if added is None:
                return False
        return True
