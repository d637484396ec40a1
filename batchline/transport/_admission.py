"""How a producer's requests and cancels reach a queue (docs/protocol.md, Admission).

``functions``: through the queue's functions (Redis >= 7): requests and cancels go to the
inbox, which workers admit; the producer needs no right to write a work stream or the cancel
stream. ``scripts``: the enqueue script adds the entries itself, and a cancel is a direct
``XADD`` (Redis 6.2, or producers that are trusted). ``auto`` calls the functions and falls
back to the script where they are missing (Redis 6.2, or no worker of this release has
loaded them yet), trying the functions again after a while.

A tenant's requests, cancels and job notes go to the tenant's inbox, with a wake, through the
tenant functions (docs/protocol.md, Tenants): only the functions can do that (the enqueue
script cannot stamp a tenant), so a tenant needs Redis >= 7 and a worker of this release.

A polled job's key (``job:<id>``, which tells *pending* from *unknown*) is written the same
two ways: through the job function, whose note the admission turns into the key (producer
rights write no key but the inbox), or, with the script, by the producer itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, Literal

import msgpack
from redis.exceptions import NoPermissionError, ResponseError

from batchline.errors import ServiceUnavailable, TenantNotAllowed
from batchline.keys import QueueKeys
from batchline.transport._cancels import CANCELS_MAXLEN
from batchline.transport._functions import (
    CANCEL,
    CANCEL_TENANT,
    ENQUEUE,
    ENQUEUE_TENANT,
    JOB,
    JOB_TENANT,
    function_missing,
)
from batchline.transport._redis import RedisClient, Script
from batchline.transport._scripts import ENQUEUE as ENQUEUE_SCRIPT

__all__ = ["Admission", "AdmissionMode", "job_note"]

logger = logging.getLogger(__name__)

AdmissionMode = Literal["auto", "functions", "scripts"]


def job_note(request_id: str, kind: str) -> bytes:
    """A job note as the job function appends it to the job list, byte for byte (msgpack
    str, as Redis's cmsgpack packs it), for ``LPOS``."""
    packed: bytes = msgpack.packb(["j", request_id, kind], use_bin_type=True)
    return packed


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
        self._told_no_lpos = False

    def check_tenant_mode(self, tenant: str) -> None:
        """ValueError where this producer's admission cannot carry a tenant (``scripts``)."""
        if self.mode == "scripts":
            raise ValueError(
                f"tenant {tenant!r}: a tenant's requests go through the queue's functions "
                "(Redis >= 7), which admission='scripts' does not use: the enqueue script "
                "cannot stamp a tenant (docs/protocol.md, Tenants)"
            )

    async def _tenant_call(
        self, client: RedisClient, name: str, tenant: str, keys: list[str], args: list[Any]
    ) -> Any:
        """One call of a tenant function; ServiceUnavailable where it is missing (no
        fallback: the script cannot stamp a tenant)."""
        self.check_tenant_mode(tenant)
        try:
            return await client.fcall(name, len(keys), *keys, tenant, *args)
        except NoPermissionError as exc:
            raise TenantNotAllowed(
                f"queue {self.keys.queue!r}: tenant {tenant!r}: this producer's Redis user may "
                f"not act as it ({exc}): its rights are another tenant's (`batchline acl "
                "--tenant NAME` gives a tenant's producer user); nothing was done"
            ) from exc
        except ResponseError as exc:
            if function_missing(exc):
                raise ServiceUnavailable(
                    f"queue {self.keys.queue!r}: tenant {tenant!r}: the function {name} is not "
                    f"loaded ({exc}): a tenant's requests need the queue's functions, which "
                    "workers of this release load as they start (Redis >= 7; on Redis 6.2 "
                    "a producer cannot name a tenant); nothing was queued"
                ) from exc
            raise

    def _tenant_keys(self, tenant: str) -> list[str]:
        return [self.keys.tenant_inbox(tenant), self.keys.wakes]

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

    async def enqueue(
        self, client: RedisClient, args: list[Any], *, max_bytes: int, tenant: str | None = None
    ) -> list[Any]:
        """One call of the enqueue function (or script) with the script's arguments; for a
        tenant, of the tenant enqueue function."""
        if tenant is not None:
            keys = [*self._tenant_keys(tenant), *self._enqueue_keys]
            more = [*args, max_bytes, self.keys.base_prefix]
            return list(await self._tenant_call(client, ENQUEUE_TENANT, tenant, keys, more))
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

    async def cancel(
        self, client: RedisClient, request_id: str, *, ttl_s: int, tenant: str | None = None
    ) -> bool:
        """Ask every worker of the queue to skip this request if it has not started it;
        returns whether the cancel went through the cancel function (its admission marks
        the id: this producer's later requests of it are attempts it does not cover), not
        straight to the cancel stream."""
        if tenant is not None:
            keys = self._tenant_keys(tenant)
            await self._tenant_call(client, CANCEL_TENANT, tenant, keys, [request_id])
            return True
        if self._functions():
            try:
                await client.fcall(CANCEL, 1, self.keys.inbox, request_id)
                return True
            except ResponseError as exc:
                self._fall_back(exc, CANCEL)
        async with client.pipeline(transaction=False) as pipe:
            pipe.xadd(
                self.keys.cancels, {"id": request_id}, maxlen=CANCELS_MAXLEN, approximate=True
            )
            pipe.expire(self.keys.cancels, ttl_s)
            await pipe.execute()
        return False

    async def mark_job(
        self,
        client: RedisClient,
        request_id: str,
        kind: str,
        *,
        ttl_s: int,
        tenant: str | None = None,
    ) -> None:
        """Mark a queued request as a polled job of ``kind``: a job note the admission
        turns into its job key, or, with the script, the key itself (``EX ttl_s``); a
        tenant's note goes to the tenant's inbox."""
        if tenant is not None:
            keys = self._tenant_keys(tenant)
            await self._tenant_call(client, JOB_TENANT, tenant, keys, [request_id, kind])
            return
        if self._functions():
            try:
                await client.fcall(JOB, 1, self.keys.job_list, request_id, kind)
                return
            except ResponseError as exc:
                self._fall_back(exc, JOB)
        await client.set(self.keys.job(request_id), kind, ex=ttl_s)

    async def job_state(
        self,
        client: RedisClient,
        request_id: str,
        kinds: Iterable[str],
        *,
        tenant: str | None = None,
    ) -> tuple[bytes | None, bytes | None]:
        """A polled job's result (its result key's bytes) and kind (its job key's, or that
        of its job note while the note waits for the admission: on the job list, or on the
        tenant's inbox), each None where absent."""
        keys = self.keys
        notes_list = keys.job_list if tenant is None else keys.tenant_inbox(tenant)
        async with client.pipeline(transaction=False) as pipe:
            pipe.get(keys.result(request_id))
            pipe.get(keys.job(request_id))
            raw, kind = await pipe.execute()
        if raw is not None or kind is not None:
            return raw, kind
        notes = {job_note(request_id, k): k for k in kinds}
        # The job list, then the job key: a note admitted between the two looks is found
        # by the second.
        try:
            async with client.pipeline(transaction=False) as pipe:
                for note in notes:
                    pipe.lpos(notes_list, note)
                pipe.get(keys.job(request_id))
                pipe.get(keys.result(request_id))
                *found, kind, raw = await pipe.execute()
        except NoPermissionError as exc:  # producer rules of an earlier release
            if not self._told_no_lpos:
                self._told_no_lpos = True
                logger.warning(
                    "queue %r: may not look for job notes in the job list (add the rules "
                    "`batchline acl` prints): a job reads unknown until a worker admits it: %s",
                    keys.queue,
                    exc,
                )
            return None, None
        if kind is None:
            places = zip(notes.values(), found, strict=True)
            waiting = [k for k, at in places if at is not None]  # LPOS: an index, or None
            kind = waiting[0].encode() if waiting else None
        return raw, kind

    async def depth(self, client: RedisClient, *, tenant: str | None = None) -> int:
        """Requests waiting or in progress: the work streams, the inbox and the admission
        list, and a tenant's own inbox (a few cancels and notes may be counted with them), and
        the requests held for the fair share."""
        async with client.pipeline(transaction=False) as pipe:
            for stream in self.keys.streams_low_first:
                pipe.xlen(stream)
            pipe.llen(self.keys.inbox)
            pipe.llen(self.keys.admitting)
            if tenant is not None:
                pipe.llen(self.keys.tenant_inbox(tenant))
            pipe.hvals(self.keys.backlog_counts)
            *counts, held = await pipe.execute()
            return int(sum(counts)) + sum(int(n) for n in held)
