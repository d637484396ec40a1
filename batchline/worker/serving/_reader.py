"""The worker's reader: ``XREADGROUP`` on every work stream, highest priority first, keeping
at most the room the serving path gives (its read-ahead window) of entries ahead of the
model, and bringing at most ``max_read_bytes`` a read (:class:`ReadCap`).

How much one read may bring. Redis cannot be asked for "entries up to N bytes", only for
COUNT entries per stream, and a worker learns an entry's size only once it holds it. So the
reader keeps the size of the largest entry it has seen lately (halved after each read that
brought nothing as large) and asks for at most ``max_read_bytes`` / (that size x streams)
entries per stream: after one large entry the next reads ask for few, and a run of small
ones brings COUNT back up.

An entry larger than any valid request (the request limits: value header plus value data,
plus the small fields) is dead-lettered as soon as it is seen, before it is decoded; its
producer gets an error result when its id is valid, and nothing that large is decoded or
kept past the read. The cap is learnt, not a promise: the read that first brings large
entries after a run of small ones may hold up to COUNT x streams of them (Redis returns
whole entries, and their size is known only once read); every read after it is capped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from redis.exceptions import ResponseError

from batchline.codec import Limits
from batchline.keys import GROUP
from batchline.transport import (
    Backoff,
    RedisClient,
    block_ms,
    own_connection,
    passing,
    redis_failure,
)
from batchline.worker.shared._consumers import ensure_groups
from batchline.worker.shared._held import Entry
from batchline.worker.shared._roles import Entrance

__all__ = ["ENTRY_SLACK_BYTES", "Entries", "ReadCap", "ReadDispatch", "Reader", "entry_bytes"]

logger = logging.getLogger(__name__)

#: The entries of one read (stream index, lowest priority first; entry id; fields).
Entries = Iterable[Entry]

#: Room for the fields of a request besides its value (id, reply, version, timestamps).
ENTRY_SLACK_BYTES = 64 << 10


def entry_bytes(raw: dict[bytes, bytes] | None) -> int:
    """The size of one stream entry's fields and values."""
    return sum(map(len, raw)) + sum(map(len, raw.values())) if raw else 0


class ReadCap:
    """The COUNT of the next read, and which entries are too large to take.

    Args:
        max_read_bytes: most bytes of entries one read should bring.
        max_entry_bytes: the largest entry a valid request can make.

    Attributes:
        largest_bytes: the largest entry seen lately (decays by half per read).
        refused: entries refused for their size so far.
    """

    def __init__(self, *, max_read_bytes: int, max_entry_bytes: int) -> None:
        self.max_read_bytes = max_read_bytes
        self.max_entry_bytes = max_entry_bytes
        self.largest_bytes = 0
        self.refused = 0

    @classmethod
    def within(cls, limits: Limits, *, max_read_bytes: int) -> ReadCap:
        """The cap of a worker that accepts requests within ``limits``."""
        largest = limits.max_meta_bytes + limits.max_blob_bytes + ENTRY_SLACK_BYTES
        return cls(max_read_bytes=max_read_bytes, max_entry_bytes=largest)

    def count(self, room: int, streams: int) -> int:
        """COUNT for one read of ``streams`` streams (COUNT applies to each stream) with
        room for ``room`` entries: the room split over the streams, lowered so that entries
        as large as the largest seen lately fill at most ``max_read_bytes``."""
        per_stream = max(1, -(-room // streams))
        if self.largest_bytes:
            per_stream = min(per_stream, self.max_read_bytes // (self.largest_bytes * streams))
        return max(1, per_stream)

    def split(self, batch: Sequence[Entry]) -> tuple[list[Entry], list[tuple[Entry, int]]]:
        """Note the sizes of one read's entries; return the entries to take, and those too
        large to be a valid request, each with its size."""
        kept: list[Entry] = []
        too_large: list[tuple[Entry, int]] = []
        largest = 0
        for item in batch:
            size = entry_bytes(item[2])
            largest = max(largest, size)
            if size > self.max_entry_bytes:
                too_large.append((item, size))
            else:
                kept.append(item)
        self.refused += len(too_large)
        self.largest_bytes = max(largest, self.largest_bytes // 2)
        return kept, too_large


class ReadDispatch(Protocol):
    """What fills the work streams just before a read (the fair share's dispatch:
    :class:`~batchline.worker.serving._dispatch.Dispatcher`)."""

    held: int  # what the backlogs held, as the last call said

    def call(self, room: int) -> list[Any] | None:
        """The ``FCALL`` to send before a read of up to ``room`` entries a stream; None:
        none."""

    def called(self, outcome: Any) -> bool:
        """Its reply, or the error it answered; whether the read may wait for entries."""

    def lost(self) -> None:
        """It was not answered (the connection failed)."""


class Reader:
    """Reads entries for one worker and hands them to its ``entrance``.

    Args:
        redis: the worker's client (the reader takes a connection of its own for the
            blocking reads).
        streams: the work streams, lowest priority first.
        worker_id: the worker's consumer name.
        readcap: bounds one read's entries by bytes.
        entrance: the serving path: how many more entries may come in now (at 0 the reader
            waits for ``space``), and where the entries of one read go.
        dispatch: the call that fills the streams before a read (the fair share's:
            :mod:`._dispatch`), sent in one round trip with a read that does not wait, of
            up to the room from each stream (what it may take was just dispatched; a read
            that waited could bring an entry in while a batch runs); where the call says
            nothing is held any more and that read brought nothing, a read that waits
            follows.
        gate: reads only while set (a worker whose model is unloaded leaves the queue to
            the workers that have it loaded: :mod:`._warm_first`).
    """

    def __init__(
        self,
        redis: RedisClient,
        streams: list[str],
        worker_id: str,
        readcap: ReadCap,
        entrance: Entrance,
        *,
        dispatch: ReadDispatch | None = None,
        gate: asyncio.Event | None = None,
    ) -> None:
        self._redis = redis
        self._streams = streams
        self._sidx = {name.encode(): i for i, name in enumerate(streams)}
        self._worker_id = worker_id
        self._readcap = readcap
        self._entrance = entrance
        self._dispatch = dispatch
        self._gate = gate
        #: True while it holds back its reads (its ``gate`` closed), not in a read.
        self.held_back = False

    async def run(self, space: asyncio.Event, stop: asyncio.Event) -> None:
        """Read until ``stop`` is set; ``space`` is set when room frees up."""
        async with own_connection(self._redis) as client:  # for the blocking reads
            await self._read_with(client, space, stop)

    async def _read_with(
        self, client: RedisClient, space: asyncio.Event, stop: asyncio.Event
    ) -> None:
        streams = {name: ">" for name in reversed(self._streams)}
        backoff = Backoff(logger, "reader")
        block = block_ms(client)  # (below the connection's socket timeout, if it has one)
        while not stop.is_set():
            room = self._entrance.room()
            # COUNT applies to each stream: split the room so the total stays within it,
            # and within max_read_bytes of entries as large as the largest seen lately.
            per_stream = self._readcap.count(room, len(streams))
            if room <= 0:
                space.clear()
                await space.wait()
                continue
            if self._gate is not None and not self._gate.is_set():
                self.held_back = True
                try:
                    await _first(self._gate, stop)
                finally:
                    self.held_back = False
                continue
            try:
                dispatch = self._dispatch
                call = None if dispatch is None else dispatch.call(room)
                response, wait = None, True
                if dispatch is not None and call is not None:
                    response, wait = await self._dispatch_and_read(
                        client, dispatch, call, streams, room
                    )
                if call is None or (wait and not response):
                    response = await client.xreadgroup(
                        GROUP, self._worker_id, streams, count=per_stream, block=block
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
                await self._entrance.accept(
                    (self._sidx[stream], entry, raw)
                    for stream, entries in response
                    for entry, raw in entries
                )

    async def _dispatch_and_read(
        self,
        client: RedisClient,
        dispatch: ReadDispatch,
        call: list[Any],
        streams: dict[str, str],
        room: int,
    ) -> tuple[Any, bool]:
        """The dispatch ``call`` and a read that does not wait, in one round trip. While
        the backlogs hold requests, what it may take was just dispatched, up to the room in
        each stream, and the read takes it (at most the room from each priority's stream);
        otherwise the room is split between the streams, as a read that waits splits it.
        Returns the read's reply and whether a read may wait (:meth:`ReadDispatch.called`)."""
        count = self._readcap.count(room, 1 if dispatch.held else len(streams))
        pipe = client.pipeline(transaction=False)
        pipe.fcall(*call)
        pipe.xreadgroup(GROUP, self._worker_id, streams, count=count)
        try:
            dispatched, response = await pipe.execute(raise_on_error=False)
        except BaseException:
            dispatch.lost()
            raise
        wait = dispatch.called(dispatched)
        if isinstance(response, BaseException):
            raise response
        return response, wait


async def _first(*events: asyncio.Event) -> None:
    """Until one of ``events`` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
