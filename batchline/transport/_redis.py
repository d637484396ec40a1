"""Redis clients and the scripts, for the producer, the worker and the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

from redis.asyncio import ConnectionPool, Redis, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.sentinel import MasterNotFoundError, SentinelConnectionPool
from redis.exceptions import AskError, MovedError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from batchline.config import ServiceSettings, redact_url
from batchline.errors import BatchlineError
from batchline.redis_url import is_sentinel_url, parse_sentinel_url
from batchline.transport._client import RedisClient
from batchline.transport._errors import (
    REDIS_FAILURES,
    RedisLibraryError,
    passing,
    redis_failure,
)
from batchline.transport._sentinel import sentinel_client

__all__ = [
    "NO_CLIENT_INFO",
    "POOL_NO_CLIENT_INFO",
    "Backoff",
    "RedisClient",
    "RedisUnreachable",
    "Script",
    "as_client",
    "connect",
    "dedicated",
    "own_connection",
    "packed_by_hiredis",
    "pinned",
    "single_node",
    "wait_for_redis",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _found
except ImportError:  # a hiredis older than its pack_command: redis-py packs
    _pack = None
else:
    _pack = _found


def as_client(client: object) -> RedisClient:
    """``client`` (a ``redis.asyncio`` ``Redis``, ``RedisCluster`` or one a sentinel made,
    with bytes replies) as the :class:`RedisClient` it is at run time."""
    return cast(RedisClient, client)


def single_node(client: RedisClient) -> Redis | None:
    """The redis-py client ``client`` is where it is exactly a single-node ``Redis`` (one
    URL or a sentinel's primary: its pool and connection can be reached), else None (a
    cluster, or a client that stands for one node of it)."""
    raw: object = client
    return raw if type(raw) is Redis else None


class RedisUnreachable(BatchlineError, ConnectionError):
    """Redis did not answer within the wait allowed; the message names the URL (its password
    redacted) and the setting to change."""


def _stream_keys(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The keys of ``XREAD``/``XREADGROUP`` arguments (after ``STREAMS``: half keys, half
    ids), or None where there is no ``STREAMS``."""
    for i, arg in enumerate(args):
        word = arg.decode() if isinstance(arg, bytes) else str(arg)
        if word.upper() == "STREAMS":
            rest = args[i + 1 :]
            return tuple(rest[: len(rest) // 2])
    return None


class _Cluster(RedisCluster):
    """redis-py's asyncio cluster client, routing the commands batchline sends with keys in
    movable places (``FCALL``, ``XREADGROUP``, ``XREAD``) from their arguments, as redis-py
    does for ``EVAL``. redis-py asks a node (``COMMAND GETKEYS``) on every such call
    instead: a round trip more, and one that fails outside redis-py's retries while that
    node goes down in a failover."""

    async def _determine_slot(self, command: str, *args: Any) -> int:
        name = command.upper() if isinstance(command, str) else str(command).upper()
        keys: tuple[Any, ...] | None = None
        if name in ("FCALL", "FCALL_RO") and len(args) >= 2:
            keys = args[2 : 2 + int(args[1])]
        elif name in ("XREADGROUP", "XREAD"):
            keys = _stream_keys(args)
        if keys:
            slots = {self.keyslot(key) for key in keys}
            if len(slots) == 1:
                return slots.pop()
        slot: int = await super()._determine_slot(command, *args)
        return slot


def _no_client_info() -> dict[str, Any]:
    """The arguments that keep a redis-py client from sending a ``CLIENT`` command as each
    connection opens, which the ACL rules of docs/protocol.md do not allow (Redis 6.2, and
    7.2 and later, record every refusal in ``ACL LOG``): ``CLIENT SETINFO`` (off with
    ``driver_info=None`` from redis-py 8, ``lib_name`` and ``lib_version`` before it, which
    redis-py 8 warns of) and redis-py 8's ``CLIENT MAINT_NOTIFICATIONS`` (with RESP3)."""
    params = inspect.signature(Redis.__init__).parameters
    if "driver_info" in params:
        quiet: dict[str, Any] = {"driver_info": None}
    else:
        quiet = {"lib_name": None, "lib_version": None}
    if "maint_notifications_config" in params:
        from redis.maint_notifications import MaintNotificationsConfig  # redis-py >= 7

        quiet["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    return quiet


#: redis-py client arguments: no ``CLIENT`` command on connect (:func:`_no_client_info`).
NO_CLIENT_INFO = _no_client_info()


def _sockets() -> dict[str, Any]:
    """How a connection waits (docs/service.md, errors): no socket timeout unless the URL
    sets one (its ``socket_timeout`` wins over this), where redis-py 8 would cut every command
    at 5 s and a Redis busy for longer (a long script, a fork on a large data set) would read
    as failing; and TCP keepalive, so that a connection whose peer went without closing it
    (a host lost, a NAT that forgot it) is found dead in about 25 s, where a blocking read
    would otherwise wait on it for ever."""
    options: dict[int, int] = {}
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # (Linux; not every platform has all three)
            options[getattr(socket, name)] = value
    return {"socket_timeout": None, "socket_keepalive": True, "socket_keepalive_options": options}


#: redis-py client arguments: :func:`_sockets`.
SOCKETS = _sockets()
#: The same for a connection pool made from another's ``connection_kwargs`` (which carry the
#: rest): the maintenance notifications are the pool's own argument.
POOL_NO_CLIENT_INFO = {k: v for k, v in NO_CLIENT_INFO.items() if k == "maint_notifications_config"}


# -- commands packed by hiredis --------------------------------------------------------------
#
# A redis-py connection class whose ``pack_command`` is hiredis's, in C, where redis-py's own
# packs each argument in Python (:func:`packed_by_hiredis`, for the clients :func:`connect`
# makes). redis-py's asyncio connections encode and frame every argument of every command in Python:
# on a 2-core CPU, a worker's call of the admit function (35 arguments) took 24.6 µs to pack,
# hiredis's ``pack_command`` 4.3 µs, the same bytes; an ``XACK`` 2.8 and 0.84 µs (with the
# look at each argument before it: 10.2 and 1.5 µs with ``isinstance``, 5.3 and 1.0 µs as
# :func:`_small` looks now, timeit, best of 7). The idle
# path sends about ten commands a request, the batched one a few a batch. What hiredis does
# not pack as redis-py does goes to redis-py's packer: a command name of several words
# (``CONFIG GET``, split there), a type hiredis refuses (a ``bytearray``; redis-py's
# ``DataError`` for a type neither packs), a connection whose encoding is not strict UTF-8,
# and a command with a large argument (over redis-py's chunk size, 6,000 bytes, or a
# memoryview), which redis-py sends as a chunk of its own rather than copied into the command.
# Without hiredis, the class is redis-py's own.

C = TypeVar("C", bound=type[AbstractConnection])

_MADE: dict[type, type] = {}


def _small(args: tuple[Any, ...], cutoff: int) -> bool:
    """Whether no argument is a memoryview or longer than ``cutoff``: redis-py sends those
    as chunks of their own, uncopied, where hiredis would copy them into one command (and
    read a strided memoryview's buffer from its start). The common types are told by
    ``type()`` first: a third of the time ``isinstance`` takes for each."""
    for arg in args:
        kind = type(arg)
        if kind is str or kind is bytes:
            if len(arg) > cutoff:
                return False
        elif (kind is not int and kind is not float) and (
            isinstance(arg, memoryview) or (isinstance(arg, bytes | str) and len(arg) > cutoff)
        ):
            return False
    return True


def packed_by_hiredis(connection_class: C) -> C:
    """``connection_class`` with hiredis's ``pack_command`` (the same class where hiredis
    is missing, or already packing)."""
    if _pack is None or getattr(connection_class, "packed_by_hiredis", False):
        return connection_class
    made = _MADE.get(connection_class)
    if made is None:
        python_packing = connection_class.pack_command
        pack = _pack

        def pack_command(self: Any, *args: Any) -> list[bytes]:
            first = args[0] if args else None
            encoder = self.encoder
            if (
                encoder.encoding == "utf-8"
                and encoder.encoding_errors == "strict"
                and not (isinstance(first, str) and " " in first)
                and not (isinstance(first, bytes) and b" " in first)
                and _small(args, self._buffer_cutoff)
            ):
                try:
                    return [pack(args)]
                except TypeError:
                    pass  # redis-py packs it, or raises its DataError
            packed: list[bytes] = python_packing(self, *args)
            return packed

        made = type(
            connection_class.__name__,
            (connection_class,),
            {
                "pack_command": pack_command,
                "packed_by_hiredis": True,
                "__module__": __name__,
                "__doc__": connection_class.__doc__,
            },
        )
        _MADE[connection_class] = made
    return made  # type: ignore[return-value]


def connect(settings: ServiceSettings) -> RedisClient:
    """An asyncio Redis (or Redis Cluster) client for ``settings.redis_url``, or one of the
    primary its sentinels name (a ``redis+sentinel://`` URL); bytes replies. Its
    connections send nothing the ACL rules of docs/protocol.md refuse (:data:`NO_CLIENT_INFO`)."""
    url = settings.redis_url.get_secret_value()
    if settings.redis_cluster:
        return as_client(_Cluster.from_url(url, **SOCKETS, **NO_CLIENT_INFO))
    if is_sentinel_url(url):
        client = sentinel_client(url, health_check_interval=30, **SOCKETS, **NO_CLIENT_INFO)
    else:
        # (a unix socket has no TCP keepalive: its connections take no such argument)
        sockets = {"socket_timeout": None} if url.startswith("unix:") else SOCKETS
        client = Redis.from_url(url, health_check_interval=30, **sockets, **NO_CLIENT_INFO)
    # hiredis packs its commands (and those of every pool made from its pool's class)
    pool = client.connection_pool
    pool.connection_class = packed_by_hiredis(pool.connection_class)
    return as_client(client)


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
        except REDIS_FAILURES as exc:
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
    pool = getattr(client, "connection_pool", None)
    if isinstance(pool, SentinelConnectionPool):
        return as_client(_SentinelDedicated(connection_pool=pool, single_connection_client=True))
    plain = single_node(client)
    if plain is not None:
        return as_client(
            Redis(connection_pool=plain.connection_pool, single_connection_client=True)
        )
    return client


def pinned(client: RedisClient, key: str) -> RedisClient:
    """One connection for a loop of writes whose last command is ``WAIT`` (durability
    ``replicated``: WAIT counts the writes made on its own connection): ``client``'s
    :func:`dedicated` connection, or, on a Redis Cluster, one connection to the node that
    holds ``key``'s slot, found again after a failover or a move."""
    if isinstance(client, RedisCluster):
        return as_client(_Pinned(client, key))
    return dedicated(client)


class _Pinned:
    """A single-connection client of the cluster node holding one key (see :func:`pinned`):
    it stands for a ``Redis`` client; a call that fails for a lost connection or a moved
    slot raises as usual, and the next finds the node again."""

    def __init__(self, cluster: RedisCluster, key: str) -> None:
        self._cluster = cluster
        self._key = key
        self._client: Redis | None = None

    async def _node_client(self) -> Redis:
        if self._client is None:
            await self._cluster.initialize()
            node = self._cluster.get_node_from_key(self._key)
            if node is None:
                raise RedisConnectionError(f"no node of the cluster holds {self._key!r}")
            # Two: the single connection of the writes and WAIT, and one for a pipeline.
            pool = ConnectionPool(
                connection_class=node.connection_class,
                max_connections=2,
                **node.connection_kwargs,
                **POOL_NO_CLIENT_INFO,
            )
            self._client = Redis(connection_pool=pool, single_connection_client=True)
        return self._client

    async def aclose(self) -> None:
        """Close the connection (the cluster client is the caller's)."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
            await client.connection_pool.disconnect()

    @property
    def connection_pool(self) -> Any:
        """The connection's pool (closed with :meth:`aclose`; a stand-in before the first
        call and after closing)."""
        return self._client.connection_pool if self._client is not None else _NoPool()

    async def _stale(self) -> None:
        await self.aclose()
        await self._cluster.nodes_manager.initialize()

    def __getattr__(self, name: str) -> Any:
        if name == "pipeline":  # after a call: on the node that call found
            if self._client is None:
                raise RedisConnectionError(f"no connection to the node of {self._key!r} yet")
            return self._client.pipeline
        if not callable(getattr(Redis, name, None)):
            raise AttributeError(name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            client = await self._node_client()
            try:
                return await getattr(client, name)(*args, **kwargs)
            except Exception as exc:
                lost = (RedisConnectionError, RedisTimeoutError, MovedError, AskError)
                if isinstance(redis_failure(exc), lost):  # redis-py's own failures too
                    await self._stale()
                raise

        return call


class _NoPool:
    async def disconnect(self) -> None:
        return None


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
        quiet_s: 0 logs every failure; more logs the first at once, then at most one line
            per ``quiet_s`` seconds, with how many failed since the last line, and one line
            when a call works again (a loop that fails while Redis is down for minutes).
    """

    def __init__(
        self, logger: logging.Logger, what: str, *, max_delay_s: float = 2.0, quiet_s: float = 0.0
    ) -> None:
        self._logger = logger
        self._what = what
        self._max_delay_s = max_delay_s
        self.delay_s = 0.05
        self._quiet_s = quiet_s
        self._quiet_until = 0.0
        self._unreported = 0  # failures not logged since the last line
        self._failed = 0  # failures since the last call that worked

    def reset(self) -> None:
        """A call worked."""
        self.delay_s = 0.05
        if self._failed:
            if self._quiet_s:
                self._logger.warning(
                    "%s: works again, after %d failed tries", self._what, self._failed
                )
            self._failed = self._unreported = 0
            self._quiet_until = 0.0

    async def wait(self, exc: BaseException) -> None:
        """Log the failure (or count it, within ``quiet_s`` of the last line) and wait
        before the next try."""
        self._failed += 1
        now = time.monotonic()
        if now >= self._quiet_until:
            shown = (
                str(exc)
                if isinstance(exc, ResponseError | RedisLibraryError)
                else type(exc).__name__
            )
            since = f" ({self._unreported} more failed tries since the last line)"
            self._logger.warning(
                "%s: %s; retrying in %.2f s%s",
                self._what,
                shown,
                self.delay_s,
                since if self._unreported else "",
            )
            self._unreported = 0
            self._quiet_until = now + self._quiet_s
        else:
            self._unreported += 1
        await asyncio.sleep(self.delay_s)  # back-off after a failed call, not a poll
        self.delay_s = min(self.delay_s * 2, self._max_delay_s)

    async def retry(self, attempt: Callable[[], Awaitable[T]], *, budget_s: float) -> T:
        """Call ``attempt`` until it works, through a Redis restart (lost connections,
        timeouts, the client library failing in its own code: :func:`redis_failure`) and
        the states Redis leaves by itself (loading its data after a restart, out of memory
        under ``noeviction``, a cluster failing over), waiting between tries; past
        ``budget_s`` seconds of waiting, or for any other error, raise it."""
        self.reset()
        waited_s = 0.0
        while True:
            try:
                result = await attempt()
            except Exception as exc:
                error = redis_failure(exc)
                lost = isinstance(error, RedisConnectionError | RedisTimeoutError | OSError)
                if not (lost or passing(exc)) or waited_s >= budget_s:
                    raise
                failed: BaseException = error or exc
            else:
                self.reset()
                return result
            waited_s += self.delay_s
            await self.wait(failed)


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
