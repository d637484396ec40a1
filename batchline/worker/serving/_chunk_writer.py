"""The worker's chunk writer: streamed generations' new tokens, pushed to their producers.

After each step the generation executor hands over, for every running request that asked
for chunks, the tokens and text it added (through :meth:`ChunkWriter.to`). They wait in an
:class:`~batchline.transport._outbox.Outbox` while a write is in flight, so one write
carries what several steps produced: one reply entry per producer per write (the chunks of
one request merged into one), ``XADD … MAXLEN ~`` and ``EXPIRE`` like the results.

A producer reads and deletes its reply entries as they come (its reader does not wait for
its callers), so a reply stream whose oldest entry is more than ``max_unread_s`` older than
the entry just written belongs to a producer that is gone (or stalled that long): its
streamed requests are cancelled (``cancel``), and end at the next step instead of running
to their end. Judged by age (both times from the entry ids, the server's clock), not by
count: the results and chunks of every worker share one reply stream, and at a few thousand
entries a second a count would take a producer's short pause for its death. A failed
write is logged and its chunks go again with the next write (the one the next step's chunks
start), not at once: dropped, they would leave a gap that makes the producer drop every
later chunk of their requests (the token-index rule), so a stream would go silent until
its result. What a producer received already is dropped there by index.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from batchline.codec._chunks import Chunk, merge_chunks, pack_chunks
from batchline.keys import QueueKeys
from batchline.transport import Outbox, RedisClient, redis_failure
from batchline.worker.serving._writer import REPLY_MAXLEN

__all__ = ["ChunkWriter"]

logger = logging.getLogger(__name__)


class ChunkWriter:
    """Writes streamed requests' chunks to their producers' reply streams.

    Args:
        client: the client to write with.
        keys: the queue's keys.
        ttl_s: a reply stream expires this long after its last write (``result_ttl_s``).
        max_unread_s: a reply stream whose oldest entry is older than this (in seconds)
            after a write is unread.
        cancel: called with the id of each request written to an unread reply stream, and
            the time (server ms) of the entry that found it unread.
    """

    def __init__(
        self,
        client: RedisClient,
        keys: QueueKeys,
        *,
        ttl_s: int,
        max_unread_s: float,
        cancel: Callable[[str, int], None],
    ) -> None:
        self._client = client
        self._keys = keys
        self._ttl_s = ttl_s
        self._max_unread_ms = max_unread_s * 1e3
        self._cancel = cancel
        self._outbox: Outbox[tuple[str, Chunk]] = Outbox(self._flush, name="batchline-chunks")
        self._unwritten: list[tuple[str, Chunk]] = []  # of a failed write, for the next one
        self._unchecked = False  # whether XRANGE was refused (logged once)

    def to(self, reply: str, request_id: str, input_hash: str) -> Callable[[Chunk], None]:
        """What takes a request's chunks for the generation executor; each goes with the
        next write (on the event loop), with the request's id and the input hash of the
        entry (``input_hash``) set."""

        def put(chunk: Chunk) -> None:
            chunk.request_id, chunk.input_hash = request_id, input_hash
            self._outbox.put((reply, chunk))

        return put

    async def drain(self) -> None:
        """Return once every chunk put so far is written (or given up)."""
        await self._outbox.drain()

    async def _flush(self, items: list[tuple[str, Chunk]]) -> None:
        items, self._unwritten = self._unwritten + items, []
        by_reply: dict[str, list[Chunk]] = {}
        for reply, chunk in items:
            by_reply.setdefault(reply, []).append(chunk)
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for reply, chunks in by_reply.items():
                    key = self._keys.reply(reply)
                    fields = pack_chunks(merge_chunks(chunks))
                    pipe.xadd(key, fields, maxlen=REPLY_MAXLEN, approximate=True)
                    pipe.expire(key, self._ttl_s)
                    pipe.xrange(key, "-", "+", count=1)  # the oldest entry not read yet
                replies = await pipe.execute(raise_on_error=False)
            failed = next((r for r in replies[0::3] if isinstance(r, Exception)), None)
            if failed is not None:
                raise failed
        except Exception as caught:
            exc = redis_failure(caught)
            if exc is None:
                raise
            logger.warning(
                "chunks for %d producers not written (they go with the next write): %s",
                len(by_reply),
                exc,
            )
            # Merged: one chunk per request however long the failures last.
            self._unwritten = [(r, c) for r, cs in by_reply.items() for c in merge_chunks(cs)]
            return
        written = zip(by_reply.items(), replies[0::3], replies[2::3], strict=True)
        for (reply, chunks), added, oldest in written:
            if isinstance(oldest, Exception):  # an ACL from before the check: +xrange
                self._log_unchecked(oldest)
                continue
            age_ms = _ms(added) - (_ms(oldest[0][0]) if oldest else _ms(added))
            if age_ms > self._max_unread_ms:
                ids = list(dict.fromkeys(c.request_id for c in chunks))
                logger.warning(
                    "reply stream of producer %s holds an entry unread for %.1f s: cancelling "
                    "its streamed requests %s",
                    reply,
                    age_ms / 1e3,
                    ids,
                )
                for rid in ids:
                    self._cancel(rid, _ms(added))  # as if read from the cancel stream

    def _log_unchecked(self, exc: Exception) -> None:
        if not self._unchecked:
            self._unchecked = True
            logger.warning("reply streams are not checked for a producer gone: %s", exc)


def _ms(entry_id: bytes | str) -> int:
    """The time part of a stream entry id (milliseconds of the server's clock)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])
