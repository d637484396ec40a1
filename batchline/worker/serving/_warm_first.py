"""Workers that hold a queue's model read first: a worker whose model is loaded by demand
and not loaded now (``load demand``, ``unload_idle_s``) holds back its reads while a live
worker of the queue has the model loaded, so that requests go where no load is needed. It
reads again as soon as no such worker is live, or the queue's unread entries outgrow what
one worker holds (the warm workers are saturated: a load is worth it), or its own model is
loaded. Decided at each heartbeat, from the workers' published statistics
(``model_state``: absent for a model loaded at start) and the work streams' lag."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from redis.exceptions import ResponseError

from batchline.keys import GROUP, QueueKeys
from batchline.transport import RedisClient
from batchline.transport.status import LIVE_WITHIN_S
from batchline.worker.models._lazy import LazyModel

__all__ = ["WarmFirst"]

logger = logging.getLogger(__name__)


class WarmFirst:
    """The read gate of a worker whose model may be unloaded: set while it may read.

    Args:
        model: the worker's model.
        keys: its queue's keys.
        worker_id: its own name (not a peer of itself).
        hold: the unread entries above which it reads even with warm peers (what one worker
            holds: ``read_ahead`` x ``batch_size``).
    """

    def __init__(self, model: LazyModel, keys: QueueKeys, worker_id: str, *, hold: int) -> None:
        self._model = model
        self._keys = keys
        self._me = worker_id.encode()
        self._hold = hold
        #: For a model by demand, closed until the first step decides (as the worker
        #: starts: a read issued before would wait in Redis ahead of the warm workers').
        self.gate = asyncio.Event()
        if not model.demand:
            self.gate.set()

    async def step(self, client: RedisClient) -> None:
        """Open or close the gate (at each heartbeat)."""
        may = self._model.state != "unloaded" or not await self._warm_peer(client)
        if not may:
            may = await self._unread(client) > self._hold
        if may != self.gate.is_set():
            logger.info(
                "worker %s: %s", self._me.decode(),
                "reading" if may else "leaving the queue to the workers with its model loaded",
            )  # fmt: skip
        (self.gate.set if may else self.gate.clear)()

    async def _warm_peer(self, client: RedisClient) -> bool:
        """Whether another live worker of the queue has the model loaded."""
        live = await client.zrangebyscore(self._keys.workers, time.time() - LIVE_WITHIN_S, "+inf")
        for peer in live:
            if peer == self._me:
                continue
            raw = await client.get(self._keys.worker_stats(peer.decode()))
            try:
                stats = json.loads(raw) if raw else None
            except ValueError:
                continue
            if isinstance(stats, dict) and stats.get("model_state", "loaded") == "loaded":
                return True
        return False

    async def _unread(self, client: RedisClient) -> int:
        """Entries of the work streams no worker has read (unknown: counted as many)."""
        total = 0
        for stream in self._keys.streams:
            try:
                groups = await client.xinfo_groups(stream)
            except ResponseError:  # no stream yet: nothing unread
                continue
            for group in groups:
                name = group.get("name")
                if (name.decode() if isinstance(name, bytes) else name) == GROUP:
                    lag = group.get("lag")
                    total += self._hold + 1 if lag is None else int(lag)
        return total
