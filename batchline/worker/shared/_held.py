"""What a worker holds: the entries it read from a work stream (so pending, its claim) and
has not yet answered (:class:`Claims`), what it keeps of each request while it runs
(:class:`Meta`, by the call made of it), and the :class:`Record` that answers an entry. The
janitor keeps the claims alive; a hung worker hands them back, and one whose model call runs
long hands back those it has not started."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from batchline.codec import Request
from batchline.drivers._base import Call
from batchline.keys import GROUP
from batchline.tracing import handed_back
from batchline.transport import RedisClient, ignoring_redis_failures, input_hash

__all__ = ["Claims", "Entry", "Meta", "Record", "Taken"]

logger = logging.getLogger(__name__)

#: One entry read: stream index, entry id, fields (None: deleted while pending).
Entry = tuple[int, bytes, dict[bytes, bytes] | None]


@dataclass(slots=True)
class Meta:
    """What the worker keeps of one request while the core batches its items."""

    sidx: int
    entry: bytes
    request: Request
    value: Any
    read_unix: float
    started_unix: float = 0.0
    batch_size: int = 0
    #: Tokens of its input, where the model counts them (``counts_tokens``): the result's tok.
    tokens: int = 0
    #: Its items (texts, query-document pairs) as the model prepared them (0: not prepared).
    items: int = 0
    _ih: str = field(default="", repr=False)
    span: Any = field(default=None, repr=False)  # its process span, tracing on (.tracing)

    def input_hash(self) -> str:
        """The input hash of this request (``ih``, docs/protocol.md), computed once: its
        result and any chunks streamed to its producer carry it."""
        if not self._ih:
            self._ih = input_hash(self.request["meta"], self.request.get("blob", b""))
        return self._ih


@dataclass(slots=True)
class Record:
    """One stream entry to answer: its result (flat fields), reply address and dead letter.

    ``status`` is the result's status, ``dead`` for a dead letter without a result, or
    ``acknowledged`` for an entry answered with neither."""

    sidx: int
    entry: bytes
    status: str = "acknowledged"
    result: bytes | None = None  # the packed result (codec.pack_result)
    request_id: str | None = None
    reply: str | None = None
    dead: list[Any] | None = field(default=None)
    # Answers computed once (serving/_writer.py's AnswerCache): for an entry the enqueue
    # script gave a cache hash (its ck), that hash and the input hash computed here; empty
    # otherwise.
    cache_hash: str = ""
    input_hash: str = ""
    tenant: str | None = None  # the entry's tn: its cache hash is that tenant's
    # Cut short (cancelled, expired, a generation ended by a cancel or its deadline): never
    # cached nor given to requests coalesced onto it, and a resubmit of its id runs again.
    cut: bool = False
    # What the completion script accounts (docs/protocol.md, Tenants): [tenant or "", its
    # estimated cost, its real cost or -1 (unknown), items, tokens, 1 if served ok else 0];
    # None: nothing (an untenanted request not served).
    account: list[Any] | None = None


#: Entries taken back from a worker, by (stream index, the delivery count to give them: None
#: keeps it).
Taken = defaultdict[tuple[int, int | None], list[bytes]]


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
        #: The calls made of the entries held, until they are answered.
        self.calls: dict[Call, Meta] = {}
        self._forgetting = threading.Lock()  # the loop and the watchdog's thread both forget

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

    def forget(self, *, started: bool) -> list[Meta]:
        """Forget the calls held that wait for the model (``started``: and those it runs),
        so that none of them is answered any more, and withdraw them from their batcher
        (cancelled: its policy drops them unrun); their entries' metadata. From the loop or,
        while it is blocked, from the watchdog's thread."""
        with self._forgetting:
            gone = [
                (call, meta)
                for call, meta in self.calls.copy().items()  # one step: no Python code runs
                if started or not meta.started_unix
            ]
            for call, _meta in gone:
                self.calls.pop(call, None)
                call.cancelled = True
        return [meta for _call, meta in gone]

    def hand_back_blocked(
        self,
        client: RedisClient,
        *,
        idle_ms: int,
        sign_off: Callable[[RedisClient], Awaitable[Any]],
    ) -> None:
        """Hand back every entry held (answers not yet written too: nothing will write them)
        from a thread while the worker's event loop is blocked, over ``client`` (of its own,
        closed here), after ``sign_off(client)``."""
        taken = self.take(self.forget(started=True), rest=True)

        async def run() -> None:
            try:
                with ignoring_redis_failures():
                    await sign_off(client)
                await self.give_back(taken, idle_ms=idle_ms, redis=client)
            finally:
                await client.aclose()

        asyncio.run(run())

    async def hand_back(self, metas: Iterable[Meta], *, idle_ms: int) -> None:
        """Give these entries back with an idle time of ``idle_ms`` (past ``claim_idle_ms``),
        so that another worker's XAUTOCLAIM takes them at once: the started ones (a hung
        batch) with their delivery count (XAUTOCLAIM adds one), the others as they were
        before this worker."""
        await self.give_back(self.take(metas), idle_ms=idle_ms)
        self.settled.set()  # whoever waits for one of them to be answered: it is not ours

    def take(self, metas: Iterable[Meta], *, rest: bool = False) -> Taken:
        """Stop holding these entries (``rest``: and every other entry held, counted as
        started: a hung worker's answers not yet written); what :meth:`give_back` takes.
        Plain set and dict operations: safe from another thread while the loop is blocked."""
        groups: Taken = defaultdict(list)
        for meta in metas:
            delivered = self.deliveries.pop(meta.entry, 1)
            retry = None if meta.started_unix else delivered - 1
            groups[(meta.sidx, retry)].append(meta.entry)
            self.held[meta.sidx].discard(meta.entry)
            handed_back(meta)
        if rest:
            for sidx, held in enumerate(self.held):
                for entry in list(held):
                    groups[(sidx, None)].append(entry)
                    held.discard(entry)
        return groups

    def take_unstarted(self) -> Taken:
        """Stop holding every entry still held, none of which became a call (read, and its
        preparing never ended: a hung load); what :meth:`give_back` takes, each with its
        delivery count as it was before this worker."""
        groups: Taken = defaultdict(list)
        for sidx, held in enumerate(self.held):
            for entry in list(held):
                groups[(sidx, self.deliveries.pop(entry, 1) - 1)].append(entry)
                held.discard(entry)
        return groups

    async def give_back(
        self, taken: Taken, *, idle_ms: int, redis: RedisClient | None = None
    ) -> None:
        """Give back what :meth:`take` took (see :meth:`hand_back`); ``redis``: a client
        other than the worker's (the watchdog's, while the worker's loop is blocked)."""
        client = self.redis if redis is None else redis
        for (sidx, retry), entries in taken.items():
            with ignoring_redis_failures():
                await client.xclaim(
                    self.streams[sidx],
                    GROUP,
                    self.worker_id,
                    0,
                    entries,
                    idle=idle_ms,
                    retrycount=retry,
                    justid=True,
                )
        if taken:
            logger.warning("handed back %d entries", sum(len(e) for e in taken.values()))
