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
  queue and whether any live worker serves it
  (:func:`batchline.transport.status.timed_out`).

The failed calls that wrote nothing a caller must account for are translated as
:func:`batchline.transport.translate` says (the HTTP API's own reads too).

Any other ``ResponseError`` (NOPERM, WRONGTYPE: a deployment fault, not a passing state)
reaches the caller as it is.
"""

from __future__ import annotations

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from batchline.errors import (
    EnqueueTimeout,
    EnqueueUncertain,
)
from batchline.transport import (
    POOL_NO_CLIENT_INFO,
    RedisClient,
    as_client,
    dedicated,
    nothing_queued,
    pinned,
    single_node,
)

__all__ = ["Failed", "connected", "uncertain", "writer_for"]


def uncertain(exc: BaseException, request_id: str) -> BaseException:
    """The error to raise, for one request, when the write carrying it failed after it was
    sent (the connection was open when it went)."""
    found = nothing_queued(exc)
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
