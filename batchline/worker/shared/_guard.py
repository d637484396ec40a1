"""A worker's model calls as its watchdog sees them, and what the worker does about one that
runs long or hangs.

Every model call runs through :meth:`Guard.call`: stamped (the watchdog reads the stamp from
its thread) and timed into the bound (``max_batch_ms``, :mod:`._watchdog`). When a call runs
long (a quarter of its bound) the worker hands back the entries it read ahead and has not
started (:meth:`Guard.release`), and reads and reclaims nothing until the call ends. When it
hangs, the worker signs off (out of the workers' set: ``batchline worker --check`` fails) and
hands back everything it holds (:meth:`Guard.abandon`), at once, from its event loop; while a
hung call blocks that loop, from the watchdog's thread over a connection of its own
(:meth:`Guard.abandon_blocked`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from redis.asyncio import ConnectionPool, Redis

from batchline.config import WorkerSettings
from batchline.transport._errors import ignoring_redis_failures
from batchline.transport._redis import POOL_NO_CLIENT_INFO, RedisClient, connect
from batchline.worker.models import Model
from batchline.worker.shared._held import Claims
from batchline.worker.upkeep._watchdog import (
    CallBound,
    Stamp,
    Timing,
    prime,
    read_timing,
    write_timing,
)

__all__ = ["Guard"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Guard:
    """The worker's model calls, for its watchdog.

    Args:
        settings: the worker's settings (``max_batch_ms``, ``claim_idle_ms``, ...).
        claims: what the worker holds.
        workers_key: the workers' set, which the worker leaves when it hangs.
        redis: the worker's client; ``own``: made from ``settings`` (the watchdog's thread
            then makes another the same way; else it copies the client's pool).
        bound_file: where the previous worker process left its slowest call, and this one
            leaves its own (see ``Worker.bound_file``).
    """

    def __init__(
        self,
        settings: WorkerSettings,
        claims: Claims,
        *,
        workers_key: str,
        redis: RedisClient,
        own: bool,
        bound_file: Callable[[], Path | None],
    ) -> None:
        self.bound = CallBound(settings.max_batch_ms)
        self.running: Stamp | None = None  # the model call running
        #: Set (by the watchdog) once a model call ran past its bound.
        self.hung = threading.Event()
        self._slow: Stamp | None = None  # the call whose read-ahead was handed back
        self._settings = settings
        self._claims = claims
        self._workers_key = workers_key
        self._redis = redis
        self._own = own
        self._bound_file = bound_file

    @property
    def slow(self) -> bool:
        """A call runs long (its read-ahead was handed back): read and reclaim nothing."""
        running = self.running
        return running is not None and running is self._slow

    def call(self, fn: Callable[[], T], work: float | None = None) -> T:
        """``fn()``, one model call of ``work`` (model calls are serialised by the batchers'
        lock, so one stamp tells the watchdog), timed into the bound."""
        self.running = stamp = (time.monotonic(), work)
        try:
            return fn()
        finally:
            self.running = None
            self.bound.observe(time.monotonic() - stamp[0], work)

    def measure(
        self,
        model: Model | None,
        *,
        pads: bool,
        padding: Callable[[int, int], None] | None,
    ) -> None:
        """Before serving (on a thread): the bound's first timings (:func:`._watchdog.prime`:
        ``model``'s warm-up batch, None for none), logged."""
        bound_file = self._bound_file()
        s = self._settings
        how = prime(
            self.bound,
            model,
            batch_size=s.batch_size,
            pads=pads,
            padding=padding,
            before=None if bound_file is None else read_timing(bound_file),
        )
        limit_ms = self.bound.limit_s() * 1e3
        logger.info(
            "worker %s: max_batch_ms=%s: %.0f ms (%s)",
            self._claims.worker_id,
            s.max_batch_ms,
            limit_ms,
            how,
        )

    def remember(self, timing: Timing) -> None:
        """The slowest recent call, for the next worker process (from the watchdog)."""
        bound_file = self._bound_file()
        if bound_file is not None:
            write_timing(bound_file, timing)

    def release(self, stamp: Stamp) -> asyncio.Future[None] | None:
        """The call ``stamp`` runs long (on the loop, from the watchdog): hand back the
        entries held and not started, so that other workers serve them; from now until it
        ends, :attr:`slow`. Returns the hand-back under way."""
        if stamp is not self.running:
            return None  # it ended meanwhile
        self._slow = stamp
        metas = self._claims.forget(started=False)
        if not metas:
            return None
        logger.warning(
            "worker %s: a model call is running long (%.1f s): handing back %d requests it "
            "read ahead",
            self._claims.worker_id,
            time.monotonic() - stamp[0],
            len(metas),
        )
        return asyncio.ensure_future(
            self._claims.hand_back(metas, idle_ms=self._settings.claim_idle_ms)
        )

    async def abandon(self) -> None:
        """Hung: sign off and hand back every entry held (on the loop)."""
        metas = self._claims.forget(started=True)
        with ignoring_redis_failures():
            await self._sign_off(self._redis)
        await self._claims.hand_back(metas, idle_ms=self._settings.claim_idle_ms)

    def abandon_blocked(self) -> None:
        """:meth:`abandon` from the watchdog's thread while the hung call blocks the loop."""
        client: RedisClient = None
        if self._own:
            client = connect(self._settings)
        elif type(self._redis) is Redis:  # the caller's client: a copy of its pool
            pool = self._redis.connection_pool
            kwargs = pool.connection_kwargs
            client = Redis(
                connection_pool=ConnectionPool(
                    connection_class=pool.connection_class, **kwargs, **POOL_NO_CLIENT_INFO
                )
            )
        if client is None:
            logger.warning("no client to hand back with: what it holds waits claim_idle_ms")
            return
        self._claims.hand_back_blocked(
            client, idle_ms=self._settings.claim_idle_ms, sign_off=self._sign_off
        )

    def _sign_off(self, client: RedisClient) -> Any:
        return client.zrem(self._workers_key, self._claims.worker_id)
