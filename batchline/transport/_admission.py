"""How a producer's requests and cancels reach a queue (docs/protocol.md, Admission).

``functions``: through the queue's functions (Redis >= 7): requests and cancels go to the
inbox, which workers admit; the producer needs no right to write a work stream or the cancel
stream. ``scripts``: the enqueue script adds the entries itself, and a cancel is a direct
``XADD`` (Redis 6.2, or producers that are trusted). ``auto`` calls the functions and falls
back to the script where they are missing (Redis 6.2, or no worker of this release has
loaded them yet), trying the functions again after a while.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from redis.exceptions import NoPermissionError, ResponseError

from batchline.errors import ServiceUnavailable
from batchline.keys import QueueKeys
from batchline.transport._cancels import CANCELS_MAXLEN
from batchline.transport._functions import CANCEL, ENQUEUE, function_missing
from batchline.transport._redis import RedisClient, Script
from batchline.transport._scripts import ENQUEUE as ENQUEUE_SCRIPT

__all__ = ["Admission", "AdmissionMode"]

logger = logging.getLogger(__name__)

AdmissionMode = Literal["auto", "functions", "scripts"]

#: How long ``auto`` uses the script after finding the functions missing.
_RETRY_FUNCTIONS_S = 10.0


class Admission:
    """One producer's way into a queue; see the module docstring.

    Args:
        keys: the queue's keys.
        mode: ``auto``, ``functions`` or ``scripts``.
    """

    def __init__(self, keys: QueueKeys, mode: AdmissionMode = "auto") -> None:
        self.keys = keys
        self.mode = mode
        self._script = Script(ENQUEUE_SCRIPT)
        self._enqueue_keys = [keys.inbox, keys.admitting, *keys.streams_low_first]
        self._functions_after = 0.0  # auto: when to try the functions again

    def _functions(self) -> bool:
        if self.mode == "auto":
            return time.monotonic() >= self._functions_after
        return self.mode == "functions"

    def _fall_back(self, exc: ResponseError, name: str) -> None:
        """A function call failed: go on with the script if the function is missing or
        refused (``auto``: an ACL from before the functions), else raise."""
        missing = function_missing(exc)
        if self.mode != "auto" or not (missing or isinstance(exc, NoPermissionError)):
            if missing:
                raise ServiceUnavailable(self._unusable(name, exc)) from exc
            raise exc
        if self._functions_after == 0.0:
            logger.info("queue %r: %s: %s; using the enqueue script", self.keys.queue, name, exc)
        self._functions_after = time.monotonic() + _RETRY_FUNCTIONS_S

    def _unusable(self, name: str, exc: BaseException) -> str:
        return (
            f"queue {self.keys.queue!r}: the function {name} is not loaded or not allowed, "
            f"and neither is the enqueue script ({exc}): the functions are loaded by workers "
            "of this release as they start (on Redis >= 7), and producer rights allow the "
            "functions only (`batchline acl`); nothing was queued"
        )

    async def enqueue(self, client: RedisClient, args: list[Any], *, max_bytes: int) -> list[Any]:
        """One call of the enqueue function (or script) with the script's arguments."""
        if self._functions():
            try:
                keys = self._enqueue_keys
                return list(await client.fcall(ENQUEUE, len(keys), *keys, *args, max_bytes))
            except ResponseError as exc:
                self._fall_back(exc, ENQUEUE)
        try:
            return list(await self._script(client, self.keys.streams_low_first, args))
        except NoPermissionError as exc:
            if self.mode != "auto":
                raise
            raise ServiceUnavailable(self._unusable(ENQUEUE, exc)) from exc

    async def cancel(self, client: RedisClient, request_id: str, *, ttl_s: int) -> None:
        """Ask every worker of the queue to skip this request if it has not started it."""
        if self._functions():
            try:
                await client.fcall(CANCEL, 1, self.keys.inbox, request_id)
                return
            except ResponseError as exc:
                self._fall_back(exc, CANCEL)
        async with client.pipeline(transaction=False) as pipe:
            pipe.xadd(
                self.keys.cancels, {"id": request_id}, maxlen=CANCELS_MAXLEN, approximate=True
            )
            pipe.expire(self.keys.cancels, ttl_s)
            await pipe.execute()

    async def depth(self, client: RedisClient) -> int:
        """Requests waiting or in progress: the work streams, the inbox and the admission
        list (a few cancels and notes may be counted with them)."""
        async with client.pipeline(transaction=False) as pipe:
            for stream in self.keys.streams_low_first:
                pipe.xlen(stream)
            pipe.llen(self.keys.inbox)
            pipe.llen(self.keys.admitting)
            return int(sum(await pipe.execute()))
