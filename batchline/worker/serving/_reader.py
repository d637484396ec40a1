"""The worker's reader: ``XREADGROUP`` on every work stream, highest priority first, keeping
at most the room the worker gives (its read-ahead window) of entries ahead of the model."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from redis.exceptions import ResponseError

from batchline.keys import GROUP
from batchline.transport._errors import passing, redis_failure
from batchline.transport._redis import Backoff, RedisClient, own_connection
from batchline.worker.serving._readcap import Entry, ReadCap
from batchline.worker.shared._consumers import ensure_groups

__all__ = ["Entries", "Reader"]

logger = logging.getLogger(__name__)

#: The entries of one read (stream index, lowest priority first; entry id; fields).
Entries = Iterable[Entry]


class Reader:
    """Reads entries for one worker and hands them to ``accept``.

    Args:
        redis: the worker's client (the reader takes a connection of its own for the
            blocking reads).
        streams: the work streams, lowest priority first.
        worker_id: the worker's consumer name.
        readcap: bounds one read's entries by bytes.
        room: how many more entries may come in now; at 0 the reader waits for ``space``.
        accept: takes the entries of one read.
    """

    def __init__(
        self,
        redis: RedisClient,
        streams: list[str],
        worker_id: str,
        readcap: ReadCap,
        *,
        room: Callable[[], int],
        accept: Callable[[Entries], Awaitable[None]],
    ) -> None:
        self._redis = redis
        self._streams = streams
        self._sidx = {name.encode(): i for i, name in enumerate(streams)}
        self._worker_id = worker_id
        self._readcap = readcap
        self._room = room
        self._accept = accept

    async def run(self, space: asyncio.Event, stop: asyncio.Event) -> None:
        """Read until ``stop`` is set; ``space`` is set when room frees up."""
        async with own_connection(self._redis) as client:  # for the blocking reads
            await self._read_with(client, space, stop)

    async def _read_with(
        self, client: RedisClient, space: asyncio.Event, stop: asyncio.Event
    ) -> None:
        streams = {name: ">" for name in reversed(self._streams)}
        backoff = Backoff(logger, "reader")
        while not stop.is_set():
            room = self._room()
            # COUNT applies to each stream: split the room so the total stays within it,
            # and within max_read_bytes of entries as large as the largest seen lately.
            per_stream = self._readcap.count(room, len(streams))
            if room <= 0:
                space.clear()
                await space.wait()
                continue
            try:
                response = await client.xreadgroup(
                    GROUP, self._worker_id, streams, count=per_stream, block=1000
                )
            except ResponseError as exc:
                if passing(exc):  # a failover, a restart under way: wait and try again
                    await backoff.wait(exc)
                    continue
                if "NOGROUP" not in str(exc):
                    raise
                logger.warning("consumer group missing (Redis lost its data?); creating it again")
                await ensure_groups(self._redis, self._streams)
                continue
            except Exception as caught:
                failure = redis_failure(caught)
                if failure is None:
                    raise
                await backoff.wait(failure)
                continue
            backoff.reset()
            if response:
                await self._accept(
                    (self._sidx[stream], entry, raw)
                    for stream, entries in response
                    for entry, raw in entries
                )
