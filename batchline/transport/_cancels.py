"""Cancellation: request ids reach the queue's cancel stream (admitted from the inbox, or
added by producers with the script: :mod:`._admission`); every worker follows that stream
and keeps the ids it read, so that checking a batch costs no round trip.

A worker starting up first reads the newest ids, at most as many entries as it may hold and
none older than ``ttl_s`` seconds (a request older than its result TTL is not worth
cancelling): its start-up does not grow with the stream. Then it blocks on the stream for new
ones. A cancel covers the entries of its id added before it (the time part of a work-stream
entry id at most the cancel entry's), so an id resubmitted after its cancel runs. Cancelling
is best effort: a request whose batch starts before its cancellation reaches the worker
(a fraction of a millisecond on a local network) is answered normally.

Anyone who may cancel may write anything to the stream, so the log takes only valid request
ids (1-128 characters of letters, digits, ``_``, ``.``, ``-``; anything else is ignored and
counted) and holds at most ``max_ids`` ids and ``max_bytes`` bytes, forgetting the oldest
first: a flood of junk or of valid ids bounds a worker's memory instead of growing it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import NoPermissionError

from batchline.keys import MAX_ID_CHARS, QueueKeys, is_name
from batchline.transport._blocking import block_ms
from batchline.transport._errors import redis_failure
from batchline.transport._redis import Backoff, RedisClient

__all__ = ["CANCELS_MAXLEN", "CancelLog", "CancelTrim"]

logger = logging.getLogger(__name__)

#: The cancel stream keeps about this many ids (``MAXLEN ~``).
CANCELS_MAXLEN = 100_000

#: What one id held costs beyond its characters: on CPython 3.11, tracemalloc over 100,000
#: ids shows 49 bytes of str header and 62 of dict slot and float (111), and the tuple of the
#: forget time and the cancel's time (72); rounded up.
ID_OVERHEAD_BYTES = 200

#: Entries read per call at start-up (newest first) and while following.
_PAGE = 1000


def entry_ms(entry_id: bytes | str) -> int:
    """The time part of a stream entry id (milliseconds of the server's clock)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


def entry_order(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id as (milliseconds, sequence), in the stream's order."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class CancelLog:
    """The request ids cancelled in the last ``ttl_s`` seconds, as one worker has read them.

    Args:
        ttl_s: how long an id is kept (the queue's result TTL).
        max_ids: most ids held; past it the oldest are forgotten.
        max_bytes: most bytes held (each id counts its length plus ``ID_OVERHEAD_BYTES``);
            past it the oldest are forgotten.
        clock: seconds, monotonic (tests pass their own).

    Attributes:
        ignored: entries read that carried no valid request id.
        evicted: ids forgotten before their TTL to stay within the caps.
    """

    def __init__(
        self,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_ids: int = 100_000,
        max_bytes: int = 16 << 20,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_ids = max_ids
        self.max_bytes = max_bytes
        self.ignored = 0
        self.evicted = 0
        self.held_bytes = 0
        self._clock = clock
        # id -> (when it is forgotten, the cancel's time in server ms, its entry's sequence
        # number), in insertion order
        self._ids: dict[str, tuple[float, float, int]] = {}
        self._last = "0-0"

    def __contains__(self, request_id: object) -> bool:
        held = self._ids.get(request_id)  # type: ignore[call-overload]
        return held is not None and held[0] > self._clock()

    def covers(
        self,
        request_id: str,
        entry_id: bytes | str,
        enqueued_ms: float = math.inf,
        after: str | None = None,
    ) -> bool:
        """Whether a cancel of ``request_id`` covers the work-stream entry ``entry_id``:
        one read, and that entry added no later than it, or enqueued (its ``ts``, the
        producer's clock) no later: a request waiting in the inbox when it was cancelled is
        added to its stream after the cancel (a cancel written straight to the stream).
        ``after``: the entry's ``ca``, the newest cancel entry as the admission added it (a
        rerun after its cancel): only a cancel entry after that one covers it."""
        held = self._ids.get(request_id)
        if held is None or held[0] <= self._clock():
            return False
        if after is not None and held[2] >= 0:  # (a cancel read from the stream)
            return (held[1], held[2]) > entry_order(after)
        return min(entry_ms(entry_id), enqueued_ms) <= held[1]

    def __len__(self) -> int:
        """How many ids are held (none past their TTL)."""
        self._forget(self._clock())
        return len(self._ids)

    def add(self, request_id: str, at_ms: float = math.inf, at_seq: int = -1) -> None:
        """Remember one cancelled id, cancelled at ``at_ms`` (server ms: the cancel entry's
        time; by default it covers every entry of the id) with the cancel entry's sequence
        number ``at_seq`` (-1: a cancel of this worker's own, not an entry of the stream: it
        is placed by its time alone), and forget those past their TTL, then the oldest while
        over a cap; an invalid id is ignored."""
        if not is_name(request_id):
            self.ignored += 1
            return
        now = self._clock()
        if self._ids.pop(request_id, None) is None:
            self.held_bytes += len(request_id) + ID_OVERHEAD_BYTES
        self._ids[request_id] = (now + self.ttl_s, at_ms, at_seq)
        self._forget(now)
        ids = self._ids
        while len(ids) > self.max_ids or self.held_bytes > self.max_bytes:
            self._drop(next(iter(ids)))
            self.evicted += 1

    def _drop(self, request_id: str) -> None:
        del self._ids[request_id]
        self.held_bytes -= len(request_id) + ID_OVERHEAD_BYTES

    def _forget(self, now: float) -> None:
        """Drop the ids past their TTL: the oldest first, so stop at the first one kept
        (each id is dropped once: constant time per id, over its life)."""
        ids = self._ids
        while ids:
            rid, (until, _at, _seq) = next(iter(ids.items()))
            if until > now:
                return
            self._drop(rid)

    def _take(self, entries: Any) -> None:
        for entry_id, fields in entries:
            self._last = entry_id
            rid = fields.get(b"id") if isinstance(fields, dict) else None
            if isinstance(rid, bytes) and len(rid) <= MAX_ID_CHARS:
                self.add(rid.decode("ascii", "replace"), *entry_order(entry_id))
            else:
                self.ignored += 1

    async def catch_up(self, redis: RedisClient, keys: QueueKeys) -> None:
        """Read the newest entries of the stream (before serving starts): at most
        ``max_ids`` of them, none older than the TTL, whatever the stream holds."""
        oldest = f"{max(0, int((time.time() - self.ttl_s) * 1e3))}-0"
        try:
            await self._newest(redis, keys, oldest)
        except NoPermissionError as exc:  # an ACL from before XREVRANGE: read them all
            logger.warning(
                "catching up on cancels by reading all of the last TTL (add +xrevrange to the "
                "worker's ACL, as `batchline acl` prints it): %s",
                exc,
            )
            self._last = oldest
            while True:
                response = await redis.xread({keys.cancels: self._last}, count=_PAGE)
                for _stream, entries in response or ():
                    self._take(entries)
                if not response or len(response[0][1]) < _PAGE:
                    return

    async def _newest(self, redis: RedisClient, keys: QueueKeys, oldest: str) -> None:
        newest: list[Any] = []
        end = "+"
        while len(newest) < self.max_ids:
            page = await redis.xrevrange(
                keys.cancels, end, oldest, count=min(_PAGE, self.max_ids - len(newest))
            )
            newest += page
            if len(page) < _PAGE:
                break
            end = "(" + (page[-1][0].decode() if isinstance(page[-1][0], bytes) else page[-1][0])
        self._take(reversed(newest))
        if not newest:  # follow from the stream's end: what comes next
            info = await redis.xrevrange(keys.cancels, "+", "-", count=1)
            self._last = info[0][0] if info else "0-0"

    async def follow(
        self, redis: RedisClient, keys: QueueKeys, running: Callable[[], bool]
    ) -> None:
        """Block on the stream for new ids while ``running()``; rides out Redis restarts."""
        backoff = Backoff(logger, "cancel reader")
        block = block_ms(redis)
        while running():
            try:
                response = await redis.xread({keys.cancels: self._last}, count=_PAGE, block=block)
            except Exception as caught:
                exc = redis_failure(caught)
                if exc is None:
                    raise
                await backoff.wait(exc)
                continue
            backoff.reset()
            for _stream, entries in response or ():
                self._take(entries)


class CancelTrim:
    """Trims the cancel stream to about ``CANCELS_MAXLEN`` entries and to the last ``ttl_s``
    seconds, however it was written (a producer's direct ``XADD``s included); a worker whose
    ACL may not (from before the functions: read-only on the stream) says so once."""

    def __init__(self, redis: RedisClient, keys: QueueKeys, ttl_s: float) -> None:
        self._redis, self._keys, self._ttl_s = redis, keys, ttl_s
        self.refused = False

    async def step(self) -> None:
        if self.refused:
            return
        oldest = f"{max(0, int((time.time() - self._ttl_s) * 1e3))}-0"
        try:
            # LIMIT 0: all at once (whole nodes of the stream go, which is cheap), not the
            # 10,000 entries an approximate trim takes by default.
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.xtrim(self._keys.cancels, maxlen=CANCELS_MAXLEN, approximate=True, limit=0)
                pipe.xtrim(self._keys.cancels, minid=oldest, approximate=True, limit=0)
                await pipe.execute()
        except NoPermissionError as exc:
            self.refused = True
            logger.warning(
                "the cancel stream is not trimmed by this worker (add +xtrim and write access "
                "to the stream, as `batchline acl` prints them): %s",
                exc,
            )
