"""The worker's admitter: what producers appended to the queue's inbox becomes work-stream
entries (and cancels), checked and decided under the worker's rights.

On Redis >= 7 producers write nothing but the inbox, through the queue's functions
(:mod:`batchline.transport._functions`; docs/protocol.md, Admission). The admitter calls the
admit function as the worker starts (what a worker that died had taken, what waits), then
blocks on the inbox with ``BLMOVE`` into the admission list, so that one blocked worker
wakes per element rather than all of them, and calls the admit function again: it admits the
admission list, then up to ``per_call`` elements of the inbox, oldest first (16 in the
first call after the wait, so that the head of a burst, where a producer puts its highest
priorities, is admitted and read before the rest), and the admitter calls it again at once
while the inbox holds more. The queue's depth bound is the
worker's ``max_queue_depth``, held there whoever wrote the inbox; what the admission refused
for it, and the errors it withheld (an element refused under an id that belongs to another
request), are logged. The entries it adds wake the
readers of every worker (``XREADGROUP BLOCK``) like any entry.

Tenants (docs/protocol.md, Tenants): a tenant's producers append to the tenant's inbox and a
wake to the wake list, which a second loop blocks on (``BLMOVE`` of the wake list onto itself,
a rotation: a wake stays in Redis until the admit function takes it), on a connection of its
own; and at most once a second the admitter mirrors the tenant store's configs into the
queue's ``tenants`` hash when the store's version moved (:class:`TenantMirror`).

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

from redis.exceptions import NoPermissionError, ResponseError

from batchline.config import WorkerSettings
from batchline.transport import (
    ADMIT,
    ADMIT_PER_CALL,
    CANCELS_MAXLEN,
    Backoff,
    RedisClient,
    TenantMirror,
    function_missing,
    load_library,
    once_keys,
    redis_failure,
)
from batchline.worker.serving._dispatch import AHEAD_AT, Dispatcher
from batchline.worker.serving._reader import ReadCap
from batchline.worker.serving._writer import DEAD_MAXLEN, REPLY_MAXLEN

__all__ = ["Admitter"]

logger = logging.getLogger(__name__)

#: Inbox elements one call of the admit function takes at most.
PER_CALL = ADMIT_PER_CALL
#: ... the first call after a wait on an empty inbox: what came first (a producer's write
#: puts its highest priorities first) is admitted, and read, before the rest of a burst.
#: (Tenants' inboxes take PER_CALL in every call: the fair share's first dispatch sees them.)
FIRST_CALL = 16
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
        wake_client: a client for the wake loop alone (it blocks on the wake list; None:
            no wake loop, tenants' inboxes are admitted with the inbox's calls).
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
        wake_client: RedisClient | None = None,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        self._client = client
        self._wake_client = wake_client
        self._mirror: TenantMirror | None = TenantMirror(settings.keys)
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
            # The tenants' keys are named from it (docs/protocol.md, Tenants).
            keys.base_prefix,
            # The fair share's block (docs/protocol.md, Tenants: the fair share).
            *dispatcher.args,
            # How long the day's usage key keeps the refusals it counts.
            settings.usage_ttl_days * 86400,
        ]
        self._ahead_at = len(self._args) - 1 - len(dispatcher.args) + AHEAD_AT  # (TTL last)
        self._max_depth = settings.max_queue_depth
        self.admitted = 0
        #: Requests refused for the queue's depth, and errors withheld (an element under an
        #: id that belongs to another request), since the worker started.
        self.refused = self.withheld = 0
        #: Tenants' requests refused for a quota (QuotaExceeded), since the worker started.
        self.over_quota = 0
        self._unreported = [0, 0]  # the same, since the last line that told them
        self._quiet_until = 0.0

    def call(self, most: int | None = None) -> list[Any]:
        """The arguments of ``FCALL`` for one call of the admit function (``most``: inbox
        elements it takes at most)."""
        self._args[self._ahead_at] = self._dispatcher.admit_ahead
        self._args[0] = PER_CALL if most is None else most
        return [ADMIT, len(self._keys), *self._keys, *self._args]

    async def admit(self, client: RedisClient | None = None) -> int:
        """One call of the admit function (on ``client``, default the admitter's); returns
        how many elements the inbox, the job list and the wake list still hold."""
        return self._took(await (client or self._client).fcall(*self.call()))

    async def wait_and_admit(self, client: RedisClient, source: str, target: str) -> int:
        """Block on ``source`` (``BLMOVE`` onto ``target``, at most _BLOCK_S), then one call
        of the admit function, sent together on ``client``: Redis runs the call as soon as
        the wait ends (a client's commands wait behind its blocked one), so an element that
        comes to an idle queue is admitted one round trip after it came, not two. Returns
        as :meth:`admit`."""
        pipe = client.pipeline(transaction=False)
        pipe.blmove(source, target, _BLOCK_S, "LEFT", "RIGHT")
        pipe.fcall(*self.call(FIRST_CALL))
        _moved, answer = await pipe.execute()
        return self._took(answer)

    def _took(self, answer: Any) -> int:
        admitted, left, refused, withheld = answer[:4]
        self.over_quota += int(answer[4]) if len(answer) > 4 else 0
        self._dispatcher.held = int(answer[5]) if len(answer) > 5 else 0
        self.admitted += int(admitted)
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
        await self.mirror()
        for _ in range(64):
            if not await self.admit():
                return

    async def mirror(self) -> None:
        """Mirror the tenants' configs if due (at most once a second; one GET). A worker
        whose user may not read the tenant store says so once and mirrors nothing."""
        if self._mirror is None:
            return
        try:
            await self._mirror.step(self._client)
        except NoPermissionError as exc:
            self._mirror = None
            logger.warning(
                "admitter: queue %r: this worker may not read the tenant store or write the "
                "queue's tenants hash (the rules `batchline acl` prints allow it): tenants' "
                "configs are not mirrored: %s",
                self.keys.queue,
                exc,
            )

    async def run_wakes(self, running: Callable[[], bool]) -> None:
        """Admit tenants' inboxes as wakes come, until ``running()`` is false (a loop of its
        own on the wake client; the inbox's loop admits them too, at least once a second)."""
        client = self._wake_client
        if client is None:
            return
        backoff = Backoff(logger, "admitter (wakes)")
        wakes = self.keys.wakes
        left = 0
        while running():
            try:
                # A rotation: the wake stays in the list until the admit function takes it.
                left = await (
                    self.admit(client) if left else self.wait_and_admit(client, wakes, wakes)
                )
            except NoPermissionError as exc:
                logger.warning(
                    "admitter: queue %r: this worker may not read the wake list (the rules "
                    "`batchline acl` prints allow it): tenants' requests wait until it may: %s",
                    self.keys.queue,
                    exc,
                )
                return
            except Exception as caught:  # the inbox's loop reloads a missing library
                failure = caught if isinstance(caught, ResponseError) else redis_failure(caught)
                if failure is None:
                    raise
                await backoff.wait(failure)
                continue
            backoff.reset()

    async def run(self, running: Callable[[], bool]) -> None:
        """Admit until ``running()`` is false; rides out Redis restarts and failovers."""
        backoff = Backoff(logger, "admitter")
        left = 1  # first, what waits (and what a worker that died had taken)
        while running():
            try:
                await self.mirror()
                # Nothing waiting: block on the inbox, then admit. Where nothing moved
                # within _BLOCK_S it admits all the same (nothing, at the cost of one call a
                # second), which finds a library gone (a failover to a node without it, a
                # FUNCTION FLUSH) while producers cannot enqueue.
                left = await (
                    self.admit()
                    if left
                    else self.wait_and_admit(self._client, self.keys.inbox, self.keys.admitting)
                )
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
