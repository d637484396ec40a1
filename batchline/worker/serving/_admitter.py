"""The worker's admitter: what producers appended to the queue's inbox becomes work-stream
entries (and cancels), checked and decided under the worker's rights.

On Redis >= 7 producers write nothing but the inbox, through the queue's functions
(:mod:`batchline.transport._functions`; docs/protocol.md, Admission). The admitter calls the
admit function as the worker starts (what a worker that died had taken, what waits), then
blocks on the inbox with ``BLMOVE`` into the admission list, so that one blocked worker
wakes per element rather than all of them, and calls the admit function again: it admits the
admission list, then up to ``per_call`` elements of the inbox, oldest first, and the
admitter calls it again at once while the inbox holds more. The queue's depth bound is the
worker's ``max_queue_depth``, held there whoever wrote the inbox; what the admission refused
for it, and the errors it withheld (an element refused under an id that belongs to another
request), are logged. The entries it adds wake the
readers of every worker (``XREADGROUP BLOCK``) like any entry.

A failover to a node without the library (or a ``FUNCTION FLUSH``) shows as a missing
function: the admitter loads it again (it calls the admit function at least once a second,
so it finds out even while producers, refused, add nothing). Redis failures are ridden out
with a back-off; nothing leaves the inbox but inside the admit function, so nothing is lost
meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import ResponseError

from batchline.config import WorkerSettings
from batchline.transport import (
    ADMIT,
    CANCELS_MAXLEN,
    Backoff,
    RedisClient,
    function_missing,
    load_library,
    once_keys,
    redis_failure,
)
from batchline.worker.serving._dispatch import Dispatcher
from batchline.worker.serving._reader import ReadCap
from batchline.worker.serving._writer import DEAD_MAXLEN, REPLY_MAXLEN

__all__ = ["Admitter"]

logger = logging.getLogger(__name__)

#: Inbox elements one call of the admit function takes at most.
PER_CALL = 512
#: How long one blocking wait on the inbox lasts (seconds), so that the loop sees a stop.
_BLOCK_S = 1.0
#: After a line telling what the admission refused, the next waits this long (seconds).
_QUIET_S = 10.0


class Admitter:
    """Admits a queue's inbox for one worker; see the module docstring.

    Args:
        client: a client for this loop alone (it blocks on the inbox).
        settings: the worker's settings (its queue, TTLs, cache).
        worker_id: named in the dead letters of refused elements.
        dispatcher: the fair share's side of the worker (None: one of its own): the admit
            function dispatches after admitting, and says how many requests the backlogs
            still hold.
    """

    def __init__(
        self,
        client: RedisClient,
        settings: WorkerSettings,
        *,
        worker_id: str,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        self._client = client
        self._dispatcher = dispatcher = dispatcher or Dispatcher(settings)
        keys = self.keys = settings.keys
        self._keys = [
            keys.admitting,
            keys.inbox,
            keys.dead,
            keys.cancels,
            keys.job_list,
            *keys.streams_low_first,
        ]
        self._args: list[Any] = [
            PER_CALL,
            worker_id,
            settings.result_ttl_s,
            settings.cache_ttl_s,
            *once_keys(keys),
            keys.reply_prefix,
            REPLY_MAXLEN,
            DEAD_MAXLEN,
            CANCELS_MAXLEN,
            # The largest request this worker accepts: a larger one is refused.
            ReadCap.within(settings.limits(), max_read_bytes=1).max_entry_bytes,
            # The queue's bound, held here whoever wrote the inbox.
            settings.max_queue_depth,
            keys.job(""),
            *dispatcher.args,
        ]
        self._max_depth = settings.max_queue_depth
        self.admitted = 0
        #: Requests refused for the queue's depth, and errors withheld (an element under an
        #: id that belongs to another request), since the worker started.
        self.refused = self.withheld = 0
        self._unreported = [0, 0]  # the same, since the last line that told them
        self._quiet_until = 0.0

    def call(self) -> list[Any]:
        """The arguments of ``FCALL`` for one call of the admit function."""
        return [ADMIT, len(self._keys), *self._keys, *self._args]

    async def admit(self) -> int:
        """One call of the admit function; returns how many elements the inbox still
        holds."""
        admitted, left, refused, withheld, held = await self._client.fcall(*self.call())
        self.admitted += int(admitted)
        self._dispatcher.held = int(held)
        if refused or withheld:
            self._tell(int(refused), int(withheld))
        return int(left)

    def _tell(self, refused: int, withheld: int) -> None:
        """Log what the admission refused or withheld: at once, then at most one line per
        _QUIET_S with what came meanwhile (a flood must not flood the log)."""
        self.refused += refused
        self.withheld += withheld
        self._unreported[0] += refused
        self._unreported[1] += withheld
        now = time.monotonic()
        if now < self._quiet_until:
            return
        self._quiet_until = now + _QUIET_S
        (refused, withheld), self._unreported = self._unreported, [0, 0]
        told = []
        if refused:
            told.append(
                f"{refused} requests refused, its work streams holding max_queue_depth="
                f"{self._max_depth} (each answered QueueFull)"
            )
        if withheld:
            told.append(
                f"{withheld} errors withheld, for elements refused under the ids of other "
                "requests (dead-lettered with withheld 1)"
            )
        logger.warning("admitter: queue %r: %s", self.keys.queue, "; ".join(told))

    async def admit_all(self) -> None:
        """Admit what the inbox holds (as the worker starts), up to 64 calls' worth: the
        admitter takes on from there."""
        for _ in range(64):
            if not await self.admit():
                return

    async def run(self, running: Callable[[], bool]) -> None:
        """Admit until ``running()`` is false; rides out Redis restarts and failovers."""
        backoff = Backoff(logger, "admitter")
        left = 1  # first, what waits (and what a worker that died had taken)
        while running():
            try:
                if not left:
                    # Nothing moved within _BLOCK_S: admit all the same (nothing, at the
                    # cost of one call a second), which finds a library gone (a failover to
                    # a node without it, a FUNCTION FLUSH) while producers cannot enqueue.
                    await self._client.blmove(
                        self.keys.inbox, self.keys.admitting, _BLOCK_S, "LEFT", "RIGHT"
                    )
                left = await self.admit()
            except ResponseError as exc:
                if function_missing(exc):
                    logger.warning("admitter: %s: loading the queue's functions again", exc)
                    await self._reload(backoff)
                else:
                    await backoff.wait(exc)
                left = 1
                continue
            except Exception as caught:
                failure = redis_failure(caught)
                if failure is None:
                    raise
                await backoff.wait(failure)
                left = 1
                continue
            backoff.reset()

    async def _reload(self, backoff: Backoff) -> None:
        try:
            if not await load_library(self._client, self.keys):
                await backoff.wait(RuntimeError("the queue's functions cannot be loaded"))
        except Exception as caught:
            exc = redis_failure(caught)
            if exc is None:
                raise
            await backoff.wait(exc)
