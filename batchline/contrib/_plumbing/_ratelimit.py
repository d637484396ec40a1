"""A tenant's quotas as HTTP headers, on every route that queues work (docs/http.md, Quotas).

OpenAI's clients read ``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-requests`` and
``x-ratelimit-reset-requests`` (and ``-tokens``: a duration such as ``1s``, ``6m0s``,
``250ms``), and, on a 429, ``retry-after-ms`` then ``Retry-After`` (whole seconds). A refusal
(:class:`~batchline.errors.QuotaExceeded`) carries the retry headers
(:func:`retry_headers`); :class:`RateLimitHeaders`, the app's middleware, adds the
``x-ratelimit-*`` headers to every answer of a caller whose key sets a requests or tokens
limit, from the counts of the minute of the queue the route used (:func:`note_queue`): one
round trip to Redis (two ``GET`` in a pipeline), only for such callers, and shared by the
answers of one tenant and queue that are sent while it is under way (about 80 us of the
API's CPU a read on a loaded 2-core machine, docs/http.md).

The counts are the admission's (docs/protocol.md, Tenants: Quotas): requests and estimated
tokens admitted in the current unix minute, per queue. The minute is the API's clock; the
admission counts by Redis's, so near a minute's turn the two may name different minutes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchline.contrib._plumbing._caller import caller_of
from batchline.errors import QuotaExceeded
from batchline.keys import QueueKeys
from batchline.tenants import TenantConfig
from batchline.transport import RedisClient, redis_failure

__all__ = [
    "RateLimitHeaders",
    "limit_headers",
    "minute_counts",
    "note_queue",
    "reset_duration",
    "retry_headers",
]

logger = logging.getLogger(__name__)

#: Where a route notes the queue it submits to, on the request's state.
_NOTE = "quota_queue"


def reset_duration(seconds: float) -> str:
    """A duration as OpenAI writes its ``x-ratelimit-reset-*`` headers (Go's format):
    ``250ms``, ``1s``, ``1.5s``, ``6m0s``."""
    ms = max(0, round(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    secs = f"{rest_ms / 1000:g}s"
    return f"{minutes}m{secs}" if minutes else secs


def retry_headers(exc: QuotaExceeded) -> dict[str, str]:
    """``Retry-After`` (whole seconds, rounded up, at least 1) and ``retry-after-ms`` (which
    OpenAI's clients prefer) of a quota refusal."""
    ms = math.ceil(exc.retry_after_s * 1000)
    return {"Retry-After": str(max(1, math.ceil(ms / 1000))), "retry-after-ms": str(ms)}


def limit_headers(
    config: TenantConfig, requests: int, tokens: int, reset_s: float
) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers of the limits ``config`` sets, after ``requests`` and
    ``tokens`` counted in the minute, which ends in ``reset_s``."""
    out: dict[str, str] = {}
    for kind, limit, used in (
        ("requests", config.requests_per_min, requests),
        ("tokens", config.tokens_per_min, tokens),
    ):
        if limit:
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, limit - used))
            out[f"x-ratelimit-reset-{kind}"] = reset_duration(reset_s)
    return out


async def minute_counts(
    client: RedisClient, keys: QueueKeys, tenant: str, now_s: float | None = None
) -> tuple[int, int, float]:
    """The tenant's requests and tokens counted in this minute on the queue of ``keys``, and
    the seconds until the next minute."""
    now = time.time() if now_s is None else now_s
    minute = int(now // 60)
    async with client.pipeline(transaction=False) as pipe:
        pipe.get(keys.quota(tenant, "r", minute))
        pipe.get(keys.quota(tenant, "t", minute))
        requests, tokens = await pipe.execute()
    return int(requests or 0), int(tokens or 0), (minute + 1) * 60 - now


def note_queue(connection: HTTPConnection, client: RedisClient | None, keys: QueueKeys) -> None:
    """Note, on the request's state, the queue a route submits to (before it submits): the
    counts :class:`RateLimitHeaders` reads are that queue's."""
    if client is not None:
        setattr(connection.state, _NOTE, (client, keys))


def _limited(config: TenantConfig) -> bool:
    return bool(config.requests_per_min or config.tokens_per_min)


class RateLimitHeaders:
    """ASGI middleware: the ``x-ratelimit-*`` headers on the answers of a caller whose key
    sets a requests or tokens limit, on routes that noted their queue (:func:`note_queue`).
    Headers an answer sets itself stay; Redis failing leaves the headers out (logged)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        #: The reads under way, by queue and tenant: answers sent meanwhile share one.
        self._reads: dict[tuple[str, str], asyncio.Future[tuple[int, int, float]]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = await self._with_headers(scope, message)
            await send(message)

        await self.app(scope, receive, sending)

    async def _with_headers(self, scope: Scope, message: Message) -> Message:
        connection = HTTPConnection(scope)
        caller = caller_of(connection)
        noted: Any = getattr(connection.state, _NOTE, None)
        if caller.tenant is None or noted is None or not _limited(caller.config):
            return message
        try:
            requests, tokens, reset_s = await self._counts(noted, caller.tenant)
        except Exception as caught:
            if redis_failure(caught) is None:
                raise
            logger.debug("rate-limit headers left out: %s", caught)
            return message
        present = {name.lower() for name, _ in message.get("headers", [])}
        added = [
            (name.encode(), value.encode())
            for name, value in limit_headers(caller.config, requests, tokens, reset_s).items()
            if name.encode() not in present
        ]
        return {**message, "headers": [*message.get("headers", []), *added]}

    async def _counts(self, noted: tuple[RedisClient, QueueKeys], tenant: str) -> Any:
        """:func:`minute_counts`, or the result of the same read under way."""
        client, keys = noted
        at = (keys.base, tenant)
        read = self._reads.get(at)
        if read is None:
            read = asyncio.ensure_future(minute_counts(client, keys, tenant))
            self._reads[at] = read

            def done(finished: asyncio.Future[tuple[int, int, float]]) -> None:
                self._reads.pop(at, None)
                if not finished.cancelled():
                    finished.exception()  # retrieved, whoever still waits for it

            read.add_done_callback(done)
        return await asyncio.shield(read)
