"""The entries a worker holds: read from a work stream (so pending, its claim) and not yet
answered. The janitor keeps them alive, a hung worker hands them back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterable

from redis.exceptions import RedisError

from batchline.transport._redis import RedisClient
from batchline.transport.keys import GROUP
from batchline.worker._answers import Meta, Record

__all__ = ["Claims"]

logger = logging.getLogger(__name__)


class Claims:
    """What one worker holds, per priority stream (``sidx``: the index in ``streams``).

    Args:
        redis: the worker's client.
        streams: the work streams, lowest priority first.
        worker_id: the worker's consumer name.
    """

    def __init__(self, redis: RedisClient, streams: list[str], worker_id: str) -> None:
        self.redis = redis
        self.streams = streams
        self.worker_id = worker_id
        self.held: list[set[bytes]] = [set() for _ in streams]
        #: Delivery counts of the reclaimed entries held (a redelivered entry runs alone).
        self.deliveries: dict[bytes, int] = {}
        #: Set whenever an answer is written (or given up), so that a waiter re-checks.
        self.settled = asyncio.Event()

    def hold(self, sidx: int, entry: bytes) -> None:
        self.held[sidx].add(entry)

    def drop(self, sidx: int, entry: bytes) -> None:
        """No longer this worker's: left pending for another to take."""
        self.held[sidx].discard(entry)

    def holds(self, sidx: int, entry: bytes) -> bool:
        return entry in self.held[sidx]

    def settle(self, records: Iterable[Record]) -> None:
        """These entries are answered (or given up): no longer this worker's to keep alive."""
        for r in records:
            self.held[r.sidx].discard(r.entry)
            self.deliveries.pop(r.entry, None)
        self.settled.set()

    async def keep_alive(self) -> None:
        """Reset the idle time of every entry held, so that nobody reclaims them."""
        for sidx, entries in enumerate(self.held):
            if entries:
                await self.redis.xclaim(
                    self.streams[sidx], GROUP, self.worker_id, 0, list(entries), justid=True
                )

    async def hand_back(self, metas: Iterable[Meta], *, idle_ms: int) -> None:
        """Give these entries back with an idle time of ``idle_ms`` (past ``claim_idle_ms``),
        so that another worker's XAUTOCLAIM takes them at once: the started ones (a hung
        batch) with their delivery count (XAUTOCLAIM adds one), the others as they were
        before this worker."""
        groups: defaultdict[tuple[int, int | None], list[bytes]] = defaultdict(list)
        for meta in metas:
            retry = None if meta.started_unix else self.deliveries.get(meta.entry, 1) - 1
            groups[(meta.sidx, retry)].append(meta.entry)
            self.held[meta.sidx].discard(meta.entry)
        for (sidx, retry), entries in groups.items():
            with contextlib.suppress(RedisError, OSError):
                await self.redis.xclaim(
                    self.streams[sidx],
                    GROUP,
                    self.worker_id,
                    0,
                    entries,
                    idle=idle_ms,
                    retrycount=retry,
                    justid=True,
                )
        logger.warning("handed back %d entries", sum(len(e) for e in groups.values()))
