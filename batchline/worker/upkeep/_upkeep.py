"""A worker's upkeep, as parts the worker owns: the janitor (keeping its claims alive,
removing the consumers of dead workers), the reclaimer (taking over what dead or hung workers
left pending, one entry at a time, each run alone; dead-lettering the poisonous), the watchdog
(a model call past its ``max_batch_ms`` bound: :mod:`._watchdog`) and the heartbeat (liveness
and statistics).

Each is given the objects it works with (the worker's
:class:`~batchline.worker.shared._held.Claims`, its
:class:`~batchline.worker.shared._guard.Guard`, its executor, its metrics and counts) and the
serving path as its :class:`~batchline.worker.shared._roles.Entrance` (whether it serves now;
where a reclaimed entry goes in, or how it is dead-lettered): the upkeep never imports the
serving path, nor it the upkeep (:mod:`batchline.worker.shared` is below both).

Containment. An entry delivered more than once may be what killed its last worker, so it
never shares a model call again: the reclaimer takes such entries one at a time and runs
each alone (on a second batcher of batch size 1 that shares the model's lock), so a poison
input crashes only itself, and its batch-mates, already redelivered, are answered.
``max_batch_ms`` bounds one model call (derived from the model's own call times by default,
:mod:`._watchdog`): past it a watchdog thread marks the worker hung, and at once it stops
reading and renewing, signs off (no heartbeat; ``--check`` fails), hands back what it holds
with ``XCLAIM ... IDLE <claim_idle_ms>`` (entries not started keep their delivery count,
``RETRYCOUNT``), writes the answers already computed, and ``Worker.run`` raises
:class:`~batchline.errors.WorkerHung`. A Python thread cannot be killed, so the process must
end: ``batchline worker`` runs the worker in a child process and starts a fresh one
(:mod:`batchline.worker._supervisor`). Handed-back entries are idle past ``claim_idle_ms`` at
once, and every worker's reclaimer looks for such entries every second (``XPENDING ...
IDLE``, one cheap call per priority), so they are served again within about a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from batchline.config import WorkerSettings
from batchline.core.stats import BatchStats
from batchline.keys import GROUP, QueueKeys
from batchline.transport import RedisClient, redis_failure
from batchline.worker.metrics import Metrics
from batchline.worker.shared._consumers import prune_consumers
from batchline.worker.shared._guard import Guard, Stamp
from batchline.worker.shared._held import Claims
from batchline.worker.shared._roles import Entrance, Executor
from batchline.worker.upkeep._watchdog import Watchdog

__all__ = [
    "Heartbeat",
    "Janitor",
    "Reclaimer",
    "Upkeep",
    "every",
    "snapshot",
]

logger = logging.getLogger(__name__)

#: How often the reclaimer looks for entries to take over (at most: a third of
#: ``claim_idle_ms`` where that is shorter); a look is one ``XPENDING ... IDLE`` per stream.
RECLAIM_EVERY_S = 1.0


async def every(
    period_s: float, what: str, step: Callable[[], Awaitable[None]], closing: Callable[[], bool]
) -> None:
    """Run ``step`` every ``period_s`` seconds until ``closing()``; a Redis failure is logged
    and the next period tries again."""
    while not closing():
        await asyncio.sleep(period_s)  # a maintenance timer, not a poll for work
        try:
            await step()
        except Exception as caught:
            exc = redis_failure(caught)
            if exc is None:
                raise
            logger.warning("%s: %s: %s", what, type(exc).__name__, exc)


class Janitor:
    """Keeps the worker's claims alive (while its model is not hung: a hung batch's claims
    lapse) and, while it serves, removes consumers idle past ``consumer_idle_ms``."""

    def __init__(
        self,
        claims: Claims,
        guard: Guard,
        *,
        consumer_idle_ms: int,
        entrance: Entrance,
    ) -> None:
        self._claims = claims
        self._consumer_idle_ms = consumer_idle_ms
        self._hung = guard.hung
        self._entrance = entrance

    async def step(self) -> None:
        if not self._hung.is_set():
            await self._claims.keep_alive()
        if self._entrance.open:
            c = self._claims
            await prune_consumers(
                c.redis, c.streams, idle_ms=self._consumer_idle_ms, keep=c.worker_id
            )


class Reclaimer:
    """Takes over entries left pending by dead (or hung) workers, one at a time.

    An entry delivered before may be what killed its worker: it runs alone, and the next is
    claimed only once it is answered, so that a crash takes no other reclaimed entry down
    with it. Entries handed back unstarted (delivered once) join the batches; entries
    delivered more than ``max_deliveries`` times are dead-lettered. It takes entries over
    only while the ``entrance`` (the serving path) is open, and hands them to it.
    """

    def __init__(
        self,
        claims: Claims,
        *,
        claim_idle_ms: int,
        max_deliveries: int,
        entrance: Entrance,
        counts: Counter[str],
    ) -> None:
        self._redis, self._streams, self._worker_id = claims.redis, claims.streams, claims.worker_id
        self._claims = claims
        self._claim_idle_ms = claim_idle_ms
        self._max_deliveries = max_deliveries
        self._entrance = entrance
        self._counts = counts

    async def step(self) -> None:
        if not self._entrance.open or not await self._anything_idle():
            return
        taken = 0
        for sidx in reversed(range(len(self._streams))):  # highest priority first
            stream = self._streams[sidx]
            cursor: Any = "0-0"
            while self._entrance.open:
                response = await self._redis.xautoclaim(
                    stream, GROUP, self._worker_id, self._claim_idle_ms, cursor, count=1
                )
                cursor = response[0]
                for entry, raw in response[1]:
                    if entry is not None:
                        taken += 1
                        await self._take_over(sidx, stream, entry, raw)
                if cursor in (b"0-0", "0-0"):
                    break
        if taken:
            self._counts["reclaimed"] += taken
            logger.info("reclaimed %d entries", taken)

    async def _anything_idle(self) -> bool:
        """Whether any stream holds an entry pending longer than ``claim_idle_ms``: one
        cheap look, so that the reclaimer may look every second (XAUTOCLAIM's walk of the
        pending entries, COUNT 1 at a time, is only for when there is something to take)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream in self._streams:
                pipe.xpending_range(stream, GROUP, "-", "+", 1, idle=self._claim_idle_ms)
            found = await pipe.execute(raise_on_error=False)
        # An error (a stream or group not there yet) is no entry to take.
        return any(isinstance(f, list) and f for f in found)

    async def _take_over(
        self, sidx: int, stream: str, entry: bytes, raw: dict[bytes, bytes] | None
    ) -> None:
        pending = await self._redis.xpending_range(stream, GROUP, entry, entry, 1)
        times = int(pending[0]["times_delivered"]) if pending else 1
        if times > self._max_deliveries and raw:
            self._claims.hold(sidx, entry)
            reason = (
                f"delivered {times} times without an answer (max_deliveries={self._max_deliveries})"
            )
            self._entrance.refuse(sidx, entry, raw, "MaxDeliveries", reason)
            return
        if times <= 1:
            await self._entrance.accept([(sidx, entry, raw)])
            return
        self._claims.deliveries[entry] = times
        await self._entrance.accept([(sidx, entry, raw)], alone=True)
        settled = self._claims.settled
        while True:
            settled.clear()
            if not self._claims.holds(sidx, entry) or not self._entrance.open:
                break
            with contextlib.suppress(asyncio.TimeoutError):  # re-check serving now and then
                await asyncio.wait_for(settled.wait(), self._claim_idle_ms / 1e3)


def snapshot(
    *,
    worker_id: str,
    model_name: str,
    counts: Counter[str],
    stats: BatchStats,
    prepare: dict[str, Any] | None = None,
    max_batch_ms: float | None = None,
    model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A worker's statistics as its heartbeat publishes them (``batchline status``);
    ``model``: those of a model loaded by demand (``model_state``, ``reading``)."""
    return {
        **(model or {}),
        "worker": worker_id,
        "pid": os.getpid(),
        "model": model_name,
        "batch_size": stats.batch_size,  # in force: chosen online in latency-SLO mode
        "timeout_ms": round(stats.timeout_ms, 3),
        "target_p99_ms": stats.target_p99_ms,
        "requests": dict(counts),
        "batches": stats.batches,
        "mean_batch_size": round(stats.mean_batch_size, 2),
        "batch_size_histogram": dict(stats.batch_size_histogram),
        "queue_wait_ms": {
            "p50": stats.queue_wait_ms.p50,
            "p95": stats.queue_wait_ms.p95,
            "p99": stats.queue_wait_ms.p99,
        },
        "model_ms": {
            "p50": stats.function_ms.p50,
            "p95": stats.function_ms.p95,
            "p99": stats.function_ms.p99,
        },
        "held": stats.queue_size,
        # the bound of a model call like the recent ones (derived with max_batch_ms auto)
        "max_batch_ms": None if max_batch_ms is None else round(max_batch_ms),
        "padding_efficiency": (
            None if stats.padding_efficiency is None else round(stats.padding_efficiency, 4)
        ),
        # decoding and tokenizing: seconds (summed over the threads), requests, threads
        "prepare": prepare,
        "time": time.time(),
    }


class Heartbeat:
    """Every ``period_s``: the worker's liveness (its score in the workers set, where
    entries older than an hour are dropped; while not ``live()``, its entry removed
    instead) and its statistics (a key expiring after three periods), and its batch figures
    to the metrics."""

    def __init__(
        self,
        redis: RedisClient,
        keys: QueueKeys,
        worker_id: str,
        *,
        period_s: float,
        stats: Callable[[], dict[str, Any]],
        batcher: Executor,
        metrics: Metrics,
        on_live: Callable[[int], None] | None = None,
        live: Callable[[], bool] = lambda: True,
    ) -> None:
        self._redis, self._keys, self._worker_id = redis, keys, worker_id
        self._on_live = on_live
        self._live = live
        self._period_s = period_s
        self._stats = stats
        self._batcher = batcher
        self._metrics = metrics

    async def run(self, beating: Callable[[], bool]) -> None:
        """Beat while ``beating()``."""
        while beating():
            try:
                await self.beat()
            except Exception as caught:
                exc = redis_failure(caught)
                if exc is None:
                    raise
                logger.warning("heartbeat: %s", type(exc).__name__)
            await asyncio.sleep(self._period_s)  # a report timer, not a poll for work

    async def beat(self) -> None:
        now = time.time()
        live_now = self._live()
        async with self._redis.pipeline(transaction=False) as pipe:
            if live_now:
                pipe.zadd(self._keys.workers, {self._worker_id: now})
            else:  # unhealthy (its model cannot load): not counted among the live
                pipe.zrem(self._keys.workers, self._worker_id)
            pipe.zremrangebyscore(self._keys.workers, "-inf", now - 3600)
            pipe.set(
                self._keys.worker_stats(self._worker_id),
                json.dumps(self._stats()),
                ex=max(1, math.ceil(3 * self._period_s)),
            )
            pipe.zcount(self._keys.workers, now - 3 * self._period_s, "+inf")
            *_, live = await pipe.execute()
        if live_now and not self._live():
            # It turned unhealthy while this beat was under way: its sign-off may have
            # landed before the beat's ZADD, which put it back among the live.
            await self._redis.zrem(self._keys.workers, self._worker_id)
            live = max(0, int(live) - 1)
        if self._on_live is not None:
            self._on_live(int(live))
        self._metrics.batches(self._batcher.stats)
        await self._metrics.refresh_tenants(self._redis, self._keys)


class Upkeep:
    """A worker's upkeep parts, built from its settings, and the tasks that run them.

    Args:
        claims: the entries the worker holds (and its client, streams and consumer name).
        guard: the worker's model calls (their bound, whether one hung).
        settings: the worker's settings (and the queue's keys).
        metrics: the worker's metrics.
        executor: the worker's main executor (its statistics to the heartbeat and metrics).
        counts: the worker's answers by status (the reclaimer adds ``reclaimed``).
        entrance: the serving path: whether the worker reads and reclaims (neither stopping
            nor hung, and no model call running long), where reclaimed entries go in (see
            :class:`Reclaimer`) and what it prepared.
        model_name: the model's name in the statistics.
        release_slow: hand back the read-ahead of a model call that runs long (a generation
            worker keeps its few).
        on_live: told, at each heartbeat, how many workers serve the queue (beat within
            three periods).
    """

    def __init__(
        self,
        claims: Claims,
        guard: Guard,
        settings: WorkerSettings,
        metrics: Metrics,
        *,
        executor: Executor,
        counts: Counter[str],
        entrance: Entrance,
        model_name: str,
        release_slow: bool = True,
        on_live: Callable[[int], None] | None = None,
        model_stats: Callable[[], dict[str, Any] | None] = lambda: None,
    ) -> None:
        s = settings
        self._claims, self._guard, self._executor = claims, guard, executor
        self._counts, self._entrance, self._model_name = counts, entrance, model_name
        self._release_slow = release_slow
        self._model_stats = model_stats
        self._period_s = s.claim_idle_ms / 3e3
        self._reclaim_s = min(self._period_s, RECLAIM_EVERY_S)
        #: Hand-backs of read-ahead under way (a model call ran long).
        self.handing_back: set[asyncio.Future[None]] = set()
        self.janitor = Janitor(
            claims, guard, consumer_idle_ms=s.consumer_idle_ms, entrance=entrance
        )
        self.reclaimer = Reclaimer(
            claims,
            claim_idle_ms=s.claim_idle_ms,
            max_deliveries=s.max_deliveries,
            entrance=entrance,
            counts=counts,
        )
        self.watchdog = Watchdog(
            guard, worker_id=claims.worker_id, metrics=metrics, max_load_s=s.max_load_s
        )
        self.heartbeat = Heartbeat(
            claims.redis,
            s.keys,
            claims.worker_id,
            period_s=s.heartbeat_s,
            stats=self.stats,
            batcher=executor,
            metrics=metrics,
            on_live=on_live,
            live=lambda: not guard.load_failing.is_set(),
        )

    def stats(self) -> dict[str, Any]:
        """The worker's statistics, as the heartbeat publishes them (:func:`snapshot`)."""
        return snapshot(
            worker_id=self._claims.worker_id,
            model_name=self._model_name,
            counts=self._counts,
            stats=self._executor.stats,
            prepare=self._entrance.prepare_stats(),
            max_batch_ms=self._guard.bound.limit_s() * 1e3,
            model=self._model_stats(),
        )

    def on_slow(self, call: Stamp) -> None:
        """A model call runs long (on the loop, from the watchdog): its read-ahead goes back
        (:meth:`Guard.release <batchline.worker.shared._guard.Guard.release>`)."""
        if not self._entrance.open or not self._release_slow:
            return
        task = self._guard.release(call)
        if task is not None:
            self.handing_back.add(task)
            task.add_done_callback(self.handing_back.discard)

    def jobs(self, closing: Callable[[], bool]) -> dict[str, Coroutine[Any, Any, None]]:
        """The janitor, reclaimer and heartbeat loops, by name, to run until ``closing()``
        (the heartbeat stops at once when the model hangs: the worker is not healthy)."""
        return {
            "janitor": every(self._period_s, "janitor", self.janitor.step, closing),
            "reclaimer": every(self._reclaim_s, "reclaimer", self.reclaimer.step, closing),
            "heartbeat": self.heartbeat.run(
                lambda: not closing() and not self._guard.hung.is_set()
            ),
        }
