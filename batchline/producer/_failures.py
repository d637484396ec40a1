"""How a producer writes (so that a failed write can be told apart) and how it reports
Redis failures: as typed batchline errors, never raw redis ones.

- Redis refusing a command for a state it will leave (out of memory under ``noeviction``,
  loading, read-only replica, a busy script, ...) or being unreachable:
  :class:`~batchline.errors.ServiceUnavailable`; the enqueue script refuses before its first
  write, so nothing was queued.
- The connection lost, or no answer within the socket timeout, with a write in flight:
  :class:`~batchline.errors.EnqueueUncertain` (:class:`~batchline.errors.EnqueueTimeout`
  for the timeout), one per request, since only the caller can decide how to find out.
- A read (``get_result``, ``queue_depth``) timing out: :class:`~batchline.errors.RequestTimeout`.
- A result that does not come in time: :class:`~batchline.errors.RequestTimeout` naming the
  queue and whether any live worker serves it (:func:`timed_out`).

Any other ``ResponseError`` (NOPERM, WRONGTYPE: a deployment fault, not a passing state)
reaches the caller as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import (
    BusyLoadingError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from batchline.errors import (
    EnqueueTimeout,
    EnqueueUncertain,
    RequestTimeout,
    ServiceUnavailable,
)
from batchline.keys import QueueKeys
from batchline.transport import (
    POOL_NO_CLIENT_INFO,
    RedisClient,
    as_client,
    dedicated,
    passing_code,
    pinned,
    redis_failure,
    single_node,
)
from batchline.transport.status import LIVE_WITHIN_S, live_worker_count

__all__ = [
    "Failed",
    "connected",
    "live_workers",
    "no_worker_hint",
    "refused",
    "timed_out",
    "translate",
    "translated",
    "uncertain",
    "writer_for",
]

#: The longest a timed-out call waits more to say whether a worker serves its queue.
_LOOK_S = 1.0


def refused(exc: BaseException) -> ServiceUnavailable | None:
    """The ServiceUnavailable for a failure that certainly queued nothing, else None."""
    if isinstance(exc, OutOfMemoryError):
        return ServiceUnavailable(f"Redis is out of memory (maxmemory): {exc}; nothing was queued")
    if isinstance(exc, RedisClusterException):  # no node it knows answered: nothing went
        return ServiceUnavailable(f"Redis Cluster: {exc}; nothing was queued")
    if isinstance(exc, BusyLoadingError | ReadOnlyError):
        return ServiceUnavailable(f"Redis cannot take writes now: {exc}; nothing was queued")
    code = passing_code(exc)
    if code is None:
        return None
    what = "out of memory (maxmemory)" if code == "OOM" else f"refusing writes ({code})"
    return ServiceUnavailable(f"Redis is {what}: {exc}; nothing was queued")


def translate(exc: BaseException) -> BaseException:
    """The error to raise for a failed call that wrote nothing a caller must account for
    (a read, a connection never made, a cancel)."""
    found = refused(exc)
    if found is not None:
        return found
    if isinstance(exc, RedisTimeoutError):
        return RequestTimeout(f"Redis did not answer in time: {exc}")
    if isinstance(exc, RedisConnectionError | OSError):
        return ServiceUnavailable(f"Redis is unreachable: {type(exc).__name__}: {exc}")
    return exc


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Redis failing inside the block (redis-py's own failures included) raised as
    :func:`translate` names it; any other exception as it is."""
    try:
        yield
    except Exception as caught:
        exc = redis_failure(caught)
        if exc is None:
            raise
        raise translate(exc) from caught


async def timed_out(client: RedisClient, keys: QueueKeys, what: str) -> RequestTimeout:
    """The RequestTimeout for ``what`` (``"no result for request X within 30 s"``): it names
    the queue and says whether any live worker serves it (one heartbeat within
    :data:`~batchline.transport.status.LIVE_WITHIN_S`), the first thing to check."""
    queue = keys.queue
    try:
        live = await live_workers(client, keys)
    except Exception as caught:
        exc = caught if isinstance(caught, TimeoutError) else redis_failure(caught)
        if exc is None:
            raise
        return RequestTimeout(
            f"{what} on queue {queue!r}; whether a live worker serves that queue is unknown "
            f"(Redis: {type(exc).__name__})"
        )
    if not live:
        return RequestTimeout(f"{what} on queue {queue!r}: {no_worker_hint(keys)}")
    return RequestTimeout(
        f"{what} on queue {queue!r}, which {live} live worker{'s' if live > 1 else ''} "
        f"serve{'' if live > 1 else 's'}: busy or slow (batchline status shows the queue's "
        "backlog and the workers' figures)"
    )


async def live_workers(client: RedisClient, keys: QueueKeys) -> int:
    """How many live workers serve the queue (one heartbeat within
    :data:`~batchline.transport.status.LIVE_WITHIN_S`); TimeoutError if Redis takes longer
    than :data:`_LOOK_S` to say, or its failure."""
    async with asyncio.timeout(_LOOK_S):
        return await live_worker_count(client, keys)


def no_worker_hint(keys: QueueKeys) -> str:
    """What to say of a queue that no live worker serves, and how to start one for it."""
    prefix = "" if keys.prefix == "batchline" else f"BATCHLINE_PREFIX={keys.prefix} "
    return (
        f"no live worker serves that queue (none sent a heartbeat within {LIVE_WITHIN_S:g} "
        f"s); start one for it, e.g. {prefix}BATCHLINE_QUEUE={keys.queue} batchline worker"
    )


def uncertain(exc: BaseException, request_id: str) -> BaseException:
    """The error to raise, for one request, when the write carrying it failed after it was
    sent (the connection was open when it went)."""
    found = refused(exc)
    if found is not None:
        return found
    if isinstance(exc, RedisTimeoutError):
        return EnqueueTimeout(request_id, f"Redis gave no answer in time ({exc})")
    if isinstance(exc, RedisConnectionError | OSError):
        return EnqueueUncertain(request_id, f"the connection was lost ({exc})")
    return exc


class Failed(Exception):
    """A write failed: the typed error for each of its requests, in order."""

    def __init__(self, errors: list[BaseException], cause: BaseException) -> None:
        super().__init__(f"a write of {len(errors)} requests failed")
        for error in errors:
            if error is not cause:
                error.__cause__ = cause
        self.errors = errors


def writer_for(client: RedisClient, *, pin: str | None = None) -> RedisClient:
    """The writer's own client: one connection, in a pool of its own, on which redis-py never
    sends a command again by itself after a lost connection (it would queue a request twice,
    unknown to anyone). A cluster client (or anything else) is used as it is."""
    plain = single_node(client)
    if plain is None:  # a cluster: pinned to the node of ``pin`` if given
        return pinned(client, pin) if pin is not None else dedicated(client)
    pool = plain.connection_pool
    kwargs = {**pool.connection_kwargs, "retry": Retry(NoBackoff(), 0)}
    own: ConnectionPool
    if isinstance(pool, SentinelConnectionPool):  # the primary its sentinels name
        kwargs.pop("connection_pool", None)  # its own, set by the new pool
        own = SentinelConnectionPool(  # type: ignore[no-untyped-call]
            pool.service_name,
            pool.sentinel_manager,
            connection_class=pool.connection_class,
            max_connections=1,
            **kwargs,
            **POOL_NO_CLIENT_INFO,
        )
    else:
        own = ConnectionPool(
            connection_class=pool.connection_class,
            max_connections=1,
            **kwargs,
            **POOL_NO_CLIENT_INFO,
        )
    return as_client(Redis(connection_pool=own, single_connection_client=True))


async def connected(client: RedisClient) -> None:
    """Make the writer's connection ready before a write is sent: open it if it is closed
    (redis-py closes it after an error), and run redis-py's periodic PING here, where its
    failure (a connection that died while idle) sends nothing: reconnect once instead."""
    plain = single_node(client)
    if plain is None:
        return
    await plain.initialize()
    connection = plain.connection
    if connection is None:
        return
    if connection.is_connected:
        try:
            await connection.check_health()  # type: ignore[no-untyped-call]
            return
        except (RedisConnectionError, RedisTimeoutError, OSError):
            await connection.disconnect()
    await connection.connect()  # type: ignore[no-untyped-call]
