"""A worker's upkeep: the janitor (keeping its claims alive, reclaiming what dead workers
left pending, dead-lettering the poisonous, removing the consumers of dead workers) and the
heartbeat (liveness and statistics).

A mixin of :class:`~batchline.worker.Worker`, kept apart so that the serving path (reading,
batching, writing) reads on its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from batchline.keys import GROUP, QueueKeys
from batchline.worker._answers import Record
from batchline.worker._consumers import prune_consumers
from batchline.worker.metrics import Metrics
from batchline.worker.models import Model

if TYPE_CHECKING:
    from batchline._aio import AioBatcher
    from batchline.config import WorkerSettings

__all__ = ["Upkeep"]

logger = logging.getLogger(__name__)


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
    _batcher: AioBatcher[Any, Any]
    _streams_low_first: list[str]
    _inflight: list[set[bytes]]
    _window: int
    _closing: bool
    _stop: asyncio.Event | None

    def _answer(self, record: Record) -> None:
        raise NotImplementedError

    def _dead_letter(
        self, sidx: int, entry: bytes, raw: dict[bytes, bytes], kind: str, reason: str
    ) -> Record:
        raise NotImplementedError

    async def _accept(self, entries: Any) -> None:
        raise NotImplementedError

    async def _janitor(self) -> None:
        period = self.settings.claim_idle_ms / 3e3
        while not self._closing:
            await asyncio.sleep(period)  # a maintenance timer, not a poll for work
            try:
                await self._keep_claims()
                if self._stop is not None and not self._stop.is_set():
                    await self._reclaim()
                    await prune_consumers(
                        self._redis,
                        self._streams_low_first,
                        idle_ms=self.settings.consumer_idle_ms,
                        keep=self.worker_id,
                    )
            except (RedisError, OSError) as exc:
                logger.warning("janitor: %s: %s", type(exc).__name__, exc)

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
        """Take over entries left pending by dead workers; dead-letter the poisonous ones."""
        s = self.settings
        for sidx in reversed(range(len(self._streams_low_first))):
            stream = self._streams_low_first[sidx]
            response = await self._redis.xautoclaim(
                stream, GROUP, self.worker_id, s.claim_idle_ms, "0-0", count=self._window
            )
            claimed = [(e, raw) for e, raw in response[1] if e is not None]
            if not claimed:
                continue
            pending = await self._redis.xpending_range(
                stream, GROUP, claimed[0][0], claimed[-1][0], len(claimed) * 2, self.worker_id
            )
            deliveries = {p["message_id"]: p["times_delivered"] for p in pending}
            fresh: list[tuple[int, bytes, dict[bytes, bytes] | None]] = []
            for entry, raw in claimed:
                times = deliveries.get(entry, 1)
                if times > s.max_deliveries and raw:
                    self._inflight[sidx].add(entry)
                    self._answer(
                        self._dead_letter(
                            sidx,
                            entry,
                            raw,
                            "MaxDeliveries",
                            f"delivered {times} times without an answer "
                            f"(max_deliveries={s.max_deliveries})",
                        )
                    )
                else:
                    fresh.append((sidx, entry, raw))
            self.counts["reclaimed"] += len(claimed)
            logger.info("reclaimed %d entries from %s", len(claimed), stream)
            if fresh:
                await self._accept(fresh)

    def stats(self) -> dict[str, Any]:
        """This worker's statistics, as published with its heartbeat."""
        st = self._batcher.stats
        return {
            "worker": self.worker_id,
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
        while not self._closing:
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
