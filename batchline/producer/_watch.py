"""No silent wait: a producer says so in its log while its requests wait on a queue that no
live worker serves, whether or not the caller set a ``timeout_s``.

One timer per producer, not per request: it runs only while some request waits for its
answer here, and fires every ``no_worker_log_s`` seconds. At each firing it compares the
request ids waiting now with those of the firing before (a set intersection, in memory): the
requests found both times have waited at least that long. Only then does it ask Redis how
many live workers serve the queue (the count a timed-out request's error gives,
:func:`~batchline.transport.status.live_workers`), and logs a warning if none does; again at
doubling intervals while it lasts (up to :data:`_MOST_GAP_S`). Requests answered within
``no_worker_log_s`` (the steady state with live workers) cost no Redis command at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

from batchline.keys import QueueKeys
from batchline.transport import RedisClient, redis_failure
from batchline.transport.status import live_workers, no_worker_hint

__all__ = ["NoWorkerWatch"]

logger = logging.getLogger(__name__)

#: The longest gap between two warnings while requests keep waiting, in seconds.
_MOST_GAP_S = 300.0


class NoWorkerWatch:
    """Watches the requests waiting in one producer (see the module docstring).

    Args:
        client: the producer's client.
        keys: its queue's keys.
        waiting: the ids of the requests waiting for an answer here (a live view).
        after_s: how long a request waits before the watch looks (0: never).
        url: the Redis URL as the log names it (its password redacted).
    """

    def __init__(
        self,
        client: RedisClient,
        keys: QueueKeys,
        waiting: Collection[str],
        *,
        after_s: float,
        url: str,
    ) -> None:
        self._client = client
        self._keys = keys
        self._waiting = waiting
        self._after_s = after_s
        self._url = url
        self._timer: asyncio.TimerHandle | None = None
        self._looking: asyncio.Task[None] | None = None
        self._seen: set[str] = set()
        self._closed = False
        self._reset()

    def _reset(self) -> None:
        """Nothing has waited long: the next stall is said at once."""
        self._since: float | None = None  # when the requests waiting now began to
        self._due = 0.0  # the loop time from which the next look may go
        self._gap = 2 * self._after_s  # the wait after the first warning, doubling

    def note(self) -> None:
        """A request waits here from now on (called as each is sent): starts the timer if
        it is off. The hot path: one attribute test while the timer runs."""
        if self._timer is None and self._after_s > 0 and not self._closed:
            self._seen = set(self._waiting)
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._after_s, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        if self._closed:
            return
        now = set(self._waiting)
        stalled = len(now & self._seen)
        self._seen = now
        if now:  # it stops when nothing waits; the next request starts it again
            self._timer = loop.call_later(self._after_s, self._tick, loop)
        if not stalled:
            self._reset()
            return
        at = loop.time()
        if self._since is None:
            self._since = at - self._after_s
        if at >= self._due and self._looking is None:
            self._looking = loop.create_task(self._look(stalled), name="batchline-no-worker")

    async def _look(self, stalled: int) -> None:
        """Ask Redis whether a live worker serves the queue; warn if none does."""
        try:
            live = await live_workers(self._client, self._keys)
        except Exception as exc:
            if not isinstance(exc, TimeoutError) and redis_failure(exc) is None:
                raise
            return  # Redis itself is the trouble: the reply reader says so
        finally:
            self._looking = None
        at = asyncio.get_running_loop().time()
        self._due = at + self._gap
        if live or self._since is None:
            return  # served (busy or slow: the caller's timeout_s says which), or over
        logger.warning(
            "%d request%s waiting for up to %.3g s on queue %r at %s: %s (said again in "
            "%.3g s while it lasts)",
            stalled,
            "s" if stalled > 1 else "",
            at - self._since,
            self._keys.queue,
            self._url,
            no_worker_hint(self._keys, self._url),
            self._gap,
        )
        self._gap = min(2 * self._gap, _MOST_GAP_S)

    async def aclose(self) -> None:
        """Stop the timer and any look in progress."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        looking = self._looking
        if looking is not None:
            looking.cancel()
            await asyncio.gather(looking, return_exceptions=True)
