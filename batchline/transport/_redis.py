"""Redis clients and the scripts, for the producer, the worker and the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.sentinel import MasterNotFoundError, SentinelConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, OutOfMemoryError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from batchline.config import ServiceSettings, redact_url
from batchline.errors import BatchlineError
from batchline.transport._sentinel import is_sentinel_url, parse_sentinel_url, sentinel_client

__all__ = [
    "Backoff",
    "RedisClient",
    "RedisUnreachable",
    "Script",
    "connect",
    "dedicated",
    "own_connection",
    "wait_for_redis",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: An asyncio ``redis.asyncio.Redis`` or ``RedisCluster`` client (bytes replies). Any to
#: mypy: redis-py types each command as returning ``Awaitable[T] | T`` for its sync and
#: async clients at once, which no ``await`` type-checks.
RedisClient: TypeAlias = Any


class RedisUnreachable(BatchlineError, ConnectionError):
    """Redis did not answer within the wait allowed; the message names the URL (its password
    redacted) and the setting to change."""


def connect(settings: ServiceSettings) -> RedisClient:
    """An asyncio Redis (or Redis Cluster) client for ``settings.redis_url``, or one of the
    primary its sentinels name (a ``redis+sentinel://`` URL); bytes replies."""
    url = settings.redis_url.get_secret_value()
    if settings.redis_cluster:
        return RedisCluster.from_url(url)
    if is_sentinel_url(url):
        return sentinel_client(url, health_check_interval=30)
    return Redis.from_url(url, health_check_interval=30)


async def wait_for_redis(client: RedisClient, settings: ServiceSettings, *, wait_s: float) -> None:
    """Return once ``client`` answers a PING; retry with back-off (0.25 s doubling up to
    5 s) for up to ``wait_s`` seconds (0: one try), logging each failure; then raise
    :class:`RedisUnreachable`.
    """
    url = redact_url(settings.redis_url.get_secret_value())
    deadline = time.monotonic() + wait_s
    delay_s = 0.25
    while True:
        try:
            await client.ping()
            return
        except (RedisError, OSError) as exc:
            left_s = deadline - time.monotonic()
            reason = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
            if left_s <= 0:
                if isinstance(exc, MasterNotFoundError):
                    spec = parse_sentinel_url(settings.redis_url.get_secret_value())
                    raise RedisUnreachable(
                        f"no primary for {spec.where()} ({reason}): check that the sentinels "
                        "run and monitor a primary under that name (SENTINEL MASTERS), or "
                        "point BATCHLINE_REDIS_URL (or --redis-url) at them"
                    ) from None
                raise RedisUnreachable(
                    f"Redis at {url} does not answer ({reason}); start it, or point "
                    "BATCHLINE_REDIS_URL (or --redis-url) at a Redis that runs"
                ) from None
            logger.warning(
                "Redis at %s does not answer (%s); retrying in %.1f s, giving up in %.0f s "
                "(BATCHLINE_REDIS_WAIT_S)",
                url,
                type(exc).__name__,
                min(delay_s, left_s),
                left_s,
            )
            await asyncio.sleep(min(delay_s, left_s))  # back-off between start-up tries
            delay_s = min(delay_s * 2, 5.0)


def dedicated(client: RedisClient) -> RedisClient:
    """A client holding one connection of ``client``'s pool for itself, for one task's loop
    of calls (a reader, a writer): it skips the pool's checkout and return on every call,
    which costs redis-py about as much CPU again as the call itself. Closing it returns the
    connection (disconnected, if a call was cut short) and leaves the pool open.

    A cluster client (or anything else) is returned as it is: it routes per key.
    """
    if isinstance(client.connection_pool, SentinelConnectionPool):
        return _SentinelDedicated(
            connection_pool=client.connection_pool, single_connection_client=True
        )
    if type(client) is Redis:
        return Redis(connection_pool=client.connection_pool, single_connection_client=True)
    return client


class _SentinelDedicated(Redis):
    """:func:`dedicated` over a Sentinel pool: a connection that was cut (a failover) asks
    the sentinels for the primary before its next command. (redis-py's single connection
    reconnects to the address it had, the old primary, for ever.)"""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        await self.initialize()
        connection = self.connection
        if connection is not None and not connection.is_connected:
            await connection.connect()  # type: ignore[no-untyped-call]  # asks the sentinels
        return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]


@contextlib.asynccontextmanager
async def own_connection(client: RedisClient) -> AsyncIterator[RedisClient]:
    """:func:`dedicated` for the length of a ``with`` block (a task's read loop)."""
    held = dedicated(client)
    try:
        yield held
    finally:
        if held is not client:
            await held.aclose()


class Backoff:
    """The wait after a failed Redis call in a loop that must ride out a Redis restart:
    0.05 s, doubling up to ``max_delay_s``, back to 0.05 s after a call that worked.

    Args:
        logger: where each failure is logged (a warning).
        what: the loop's name in that line, e.g. ``"reader"``.
        max_delay_s: the longest wait.
    """

    def __init__(self, logger: logging.Logger, what: str, *, max_delay_s: float = 2.0) -> None:
        self._logger = logger
        self._what = what
        self._max_delay_s = max_delay_s
        self.delay_s = 0.05

    def reset(self) -> None:
        """A call worked."""
        self.delay_s = 0.05

    async def wait(self, exc: BaseException) -> None:
        """Log the failure and wait before the next try."""
        shown = str(exc) if isinstance(exc, ResponseError) else type(exc).__name__
        self._logger.warning("%s: %s; retrying in %.2f s", self._what, shown, self.delay_s)
        await asyncio.sleep(self.delay_s)  # back-off after a failed call, not a poll
        self.delay_s = min(self.delay_s * 2, self._max_delay_s)

    async def retry(self, attempt: Callable[[], Awaitable[T]], *, budget_s: float) -> T:
        """Call ``attempt`` until it works, through a Redis restart (lost connections,
        timeouts) and the states Redis leaves by itself (loading its data after a restart,
        out of memory under ``noeviction``), waiting between tries; past ``budget_s``
        seconds of waiting, or for any other error, raise it."""
        self.reset()
        waited_s = 0.0
        while True:
            try:
                result = await attempt()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                if waited_s >= budget_s:
                    raise
                error: BaseException = exc
            except ResponseError as exc:
                text = str(exc)
                passing = isinstance(exc, OutOfMemoryError) or "LOADING" in text or "OOM" in text
                if not passing or waited_s >= budget_s:
                    raise
                error = exc
            else:
                self.reset()
                return result
            waited_s += self.delay_s
            await self.wait(error)


class Script:
    """A Lua script called by its SHA, loaded again where a server does not know it yet.

    Unlike redis-py's Script object, this passes the keys on every call, so a cluster client
    routes the call to the node that holds them.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = ""

    async def __call__(self, client: RedisClient, keys: list[str], args: list[Any]) -> Any:
        if not self.sha:
            self.sha = await client.script_load(self.source)
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await client.eval(self.source, len(keys), *keys, *args)
