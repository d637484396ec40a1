"""A worker's upkeep: the janitor (keeping its claims alive, removing the consumers of dead
workers), the reclaimer (taking over what dead workers left pending, one entry at a time, each
run alone; dead-lettering the poisonous), the watchdog (a model call past ``max_batch_ms``) and
the heartbeat (liveness and statistics).

A mixin of :class:`~batchline.worker.Worker`, kept apart so that the serving path (reading,
batching, writing) reads on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import threading
import time
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from batchline.keys import GROUP, QueueKeys
from batchline.worker._answers import Meta, Record
from batchline.worker._consumers import prune_consumers
from batchline.worker.metrics import Metrics
from batchline.worker.models import Model

if TYPE_CHECKING:
    from batchline.config import WorkerSettings
    from batchline.worker._generate import Executor

__all__ = ["HUNG_EXIT_CODE", "Upkeep"]

logger = logging.getLogger(__name__)

#: Exit status of a worker process that ended itself because its model hung.
HUNG_EXIT_CODE = 70
#: How long the watchdog gives the event loop to answer before it ends the process (when
#: the hung call runs on the loop itself, nothing else could).
_LOOP_GRACE_S = 10.0


class Upkeep:
    """The janitor and heartbeat tasks of a worker (which provides these attributes)."""

    settings: WorkerSettings
    keys: QueueKeys
    worker_id: str
    model: Model
    metrics: Metrics
    counts: Counter[str]
    _model_name: str
    _redis: Any
    _batcher: Executor
    _streams_low_first: list[str]
    _inflight: list[set[bytes]]
    _window: int
    _closing: bool
    _stop: asyncio.Event | None
    _settled: asyncio.Event | None
    _meta: dict[Any, Meta]
    _deliveries: dict[bytes, int]
    _model_since: float | None
    _hung: threading.Event
    #: End the process if a hung model call blocks the event loop (``batchline worker``).
    exit_if_loop_blocked = False

    def stop(self) -> None:
        raise NotImplementedError

    def _answer(self, record: Record) -> None:
        raise NotImplementedError

    def _dead_letter(
        self, sidx: int, entry: bytes, raw: dict[bytes, bytes], kind: str, reason: str
    ) -> Record:
        raise NotImplementedError

    async def _accept(self, entries: Any, *, alone: bool = False) -> None:
        raise NotImplementedError

    def _serving(self) -> bool:
        return self._stop is not None and not self._stop.is_set() and not self._hung.is_set()

    async def _janitor(self) -> None:
        period = self.settings.claim_idle_ms / 3e3
        while not self._closing:
            await asyncio.sleep(period)  # a maintenance timer, not a poll for work
            try:
                if not self._hung.is_set():  # a hung batch's claims lapse
                    await self._keep_claims()
                if self._serving():
                    await prune_consumers(
                        self._redis,
                        self._streams_low_first,
                        idle_ms=self.settings.consumer_idle_ms,
                        keep=self.worker_id,
                    )
            except (RedisError, OSError) as exc:
                logger.warning("janitor: %s: %s", type(exc).__name__, exc)

    async def _reclaimer(self) -> None:
        period = self.settings.claim_idle_ms / 3e3
        while not self._closing:
            await asyncio.sleep(period)  # a maintenance timer, not a poll for work
            try:
                if self._serving():
                    await self._reclaim()
            except (RedisError, OSError) as exc:
                logger.warning("reclaimer: %s: %s", type(exc).__name__, exc)

    async def _keep_claims(self) -> None:
        """Reset the idle time of the entries this worker holds, so nobody reclaims them."""
        for sidx, entries in enumerate(self._inflight):
            if entries:
                await self._redis.xclaim(
                    self._streams_low_first[sidx],
                    GROUP,
                    self.worker_id,
                    0,
                    list(entries),
                    justid=True,
                )

    async def _reclaim(self) -> None:
        """Take over entries left pending by dead (or hung) workers, one at a time.

        An entry delivered before may be what killed its worker: it runs alone, and the next
        is claimed only once it is answered, so that a crash takes no other reclaimed entry
        down with it. Entries handed back unstarted (delivered once) join the batches.
        """
        taken = 0
        for sidx in reversed(range(len(self._streams_low_first))):
            stream = self._streams_low_first[sidx]
            cursor: Any = "0-0"
            while self._serving():
                response = await self._redis.xautoclaim(
                    stream, GROUP, self.worker_id, self.settings.claim_idle_ms, cursor, count=1
                )
                cursor = response[0]
                for entry, raw in response[1]:
                    if entry is not None:
                        taken += 1
                        await self._take_over(sidx, stream, entry, raw)
                if cursor in (b"0-0", "0-0"):
                    break
        if taken:
            self.counts["reclaimed"] += taken
            logger.info("reclaimed %d entries", taken)

    async def _take_over(
        self, sidx: int, stream: str, entry: bytes, raw: dict[bytes, bytes] | None
    ) -> None:
        s = self.settings
        pending = await self._redis.xpending_range(stream, GROUP, entry, entry, 1)
        times = int(pending[0]["times_delivered"]) if pending else 1
        if times > s.max_deliveries and raw:
            self._inflight[sidx].add(entry)
            reason = (
                f"delivered {times} times without an answer (max_deliveries={s.max_deliveries})"
            )
            self._answer(self._dead_letter(sidx, entry, raw, "MaxDeliveries", reason))
            return
        if times <= 1:
            await self._accept([(sidx, entry, raw)])
            return
        self._deliveries[entry] = times
        await self._accept([(sidx, entry, raw)], alone=True)
        settled = self._settled
        while settled is not None:
            settled.clear()
            if entry not in self._inflight[sidx] or not self._serving():
                break
            with contextlib.suppress(asyncio.TimeoutError):  # re-check serving now and then
                await asyncio.wait_for(settled.wait(), s.claim_idle_ms / 1e3)

    # -- a model call past max_batch_ms --------------------------------------------------------

    def _start_watchdog(
        self, loop: asyncio.AbstractEventLoop, hung: asyncio.Event
    ) -> threading.Event:
        """Watch model calls from a thread (a hung call may block the loop); returns the
        event that ends the watch."""
        done = threading.Event()
        limit_s = self.settings.max_batch_ms / 1e3
        if limit_s <= 0:
            return done
        seen = threading.Event()

        def on_hung() -> None:  # on the loop
            seen.set()
            hung.set()
            self.stop()

        def watch() -> None:
            while not done.wait(min(limit_s / 4, 1.0)):  # a watchdog timer
                since = self._model_since
                if since is None or time.monotonic() - since <= limit_s:
                    continue
                logger.error(
                    "worker %s: a model call has run %.1f s, past max_batch_ms=%d: handing "
                    "back what it holds and stopping",
                    self.worker_id,
                    time.monotonic() - since,
                    self.settings.max_batch_ms,
                )
                self._hung.set()
                self.metrics.unhealthy()
                with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to do
                    loop.call_soon_threadsafe(on_hung)
                if not seen.wait(_LOOP_GRACE_S) and self.exit_if_loop_blocked:
                    logger.critical("the hung model call blocks the event loop: exiting")
                    logging.shutdown()
                    os._exit(HUNG_EXIT_CODE)
                return

        threading.Thread(target=watch, name="batchline-watchdog", daemon=True).start()
        return done

    async def _hand_back(self) -> None:
        """Give every held entry back with an idle time past ``claim_idle_ms``, so another
        worker's XAUTOCLAIM takes it at once: the started ones (the hung batch) with their
        delivery count (XAUTOCLAIM adds one), the others as they were before this worker."""
        groups: defaultdict[tuple[int, int | None], list[bytes]] = defaultdict(list)
        for meta in self._meta.values():
            retry = None if meta.started_unix else self._deliveries.get(meta.entry, 1) - 1
            groups[(meta.sidx, retry)].append(meta.entry)
            self._inflight[meta.sidx].discard(meta.entry)
        self._meta.clear()
        for (sidx, retry), entries in groups.items():
            with contextlib.suppress(RedisError, OSError):
                await self._redis.xclaim(
                    self._streams_low_first[sidx],
                    GROUP,
                    self.worker_id,
                    0,
                    entries,
                    idle=self.settings.claim_idle_ms,
                    retrycount=retry,
                    justid=True,
                )
        logger.warning("handed back %d entries", sum(len(e) for e in groups.values()))

    def stats(self) -> dict[str, Any]:
        """This worker's statistics, as published with its heartbeat."""
        st = self._batcher.stats
        return {
            "worker": self.worker_id,
            "pid": os.getpid(),
            "model": self._model_name,
            "batch_size": self.settings.batch_size,
            "requests": dict(self.counts),
            "batches": st.batches,
            "mean_batch_size": round(st.mean_batch_size, 2),
            "batch_size_histogram": dict(st.batch_size_histogram),
            "queue_wait_ms": {
                "p50": st.queue_wait_ms.p50,
                "p95": st.queue_wait_ms.p95,
                "p99": st.queue_wait_ms.p99,
            },
            "model_ms": {
                "p50": st.function_ms.p50,
                "p95": st.function_ms.p95,
                "p99": st.function_ms.p99,
            },
            "held": self._batcher.queue_size,
            "padding_efficiency": _padding(self.model),
            "time": time.time(),
        }

    async def _heartbeat(self) -> None:
        period = self.settings.heartbeat_s
        while not self._closing and not self._hung.is_set():
            try:
                now = time.time()
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.zadd(self.keys.workers, {self.worker_id: now})
                    pipe.zremrangebyscore(self.keys.workers, "-inf", now - 3600)
                    pipe.set(
                        self.keys.worker_stats(self.worker_id),
                        json.dumps(self.stats()),
                        ex=max(1, math.ceil(3 * period)),
                    )
                    await pipe.execute()
                self.metrics.batches(self._batcher.stats)
            except (RedisError, OSError) as exc:
                logger.warning("heartbeat: %s", type(exc).__name__)
            await asyncio.sleep(period)  # a report timer, not a poll for work


def _padding(model: Model) -> float | None:
    """Real / padded tokens over every batch so far, for models that pad (else None)."""
    padded = getattr(model, "padded_tokens", 0)
    return round(getattr(model, "real_tokens", 0) / padded, 4) if padded else None
