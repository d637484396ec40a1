"""The Redis commands batchline sends, as a type: :class:`RedisClient` and the pipeline it
opens, :class:`RedisPipeline`.

redis-py types each command for its sync and async clients at once (``T | Awaitable[T]``,
and ``bytes | str`` for whichever ``decode_responses`` a client was made with), which no
``await`` can check. batchline's clients are always asyncio ones with bytes replies
(:func:`batchline.transport.connect`), so these protocols spell the commands it uses as
coroutines that return bytes; :func:`~batchline.transport.as_client` is the one place a
redis-py client becomes one. Keyword names are redis-py's own: a test
(tests/transport/test_client_type.py) holds every method here against
``redis.asyncio.Redis`` and ``RedisCluster``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol

from redis.asyncio import Redis, RedisCluster

__all__ = [
    "Key",
    "Members",
    "RedisArgument",
    "RedisClient",
    "RedisPipeline",
    "Value",
]

#: A key (or a stream, group or consumer name) as batchline passes one.
Key = str | bytes
#: A value Redis stores: it encodes numbers itself.
Value = str | bytes | int | float
#: A set's members.
Members = set[bytes]


class RedisPipeline(Protocol):
    """A pipeline (``MULTI``/``EXEC`` where opened with ``transaction=True``): the commands
    queue and return the pipeline; :meth:`execute` sends them and returns their replies.
    Between :meth:`watch` and :meth:`multi` a command runs at once instead: the reads
    made there (``get``, ``hget``, ``hgetall``) are typed ``Any``, the pipeline or the
    coroutine."""

    async def __aenter__(self) -> RedisPipeline: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> None: ...

    async def execute(self, raise_on_error: bool = True) -> list[Any]: ...

    async def watch(self, *names: Key) -> bool: ...

    def multi(self) -> None: ...

    def get(self, name: Key) -> Any: ...

    def set(
        self,
        name: Key,
        value: Value,
        ex: int | None = None,
        px: int | None = None,
        nx: bool = False,
        xx: bool = False,
    ) -> RedisPipeline: ...

    def delete(self, *names: Key) -> RedisPipeline: ...

    def expire(self, name: Key, time: int) -> RedisPipeline: ...

    def pexpire(self, name: Key, time: int) -> RedisPipeline: ...

    def persist(self, name: Key) -> RedisPipeline: ...

    def hget(self, name: Key, key: Key) -> Any: ...

    def hgetall(self, name: Key) -> Any: ...
    def hvals(self, name: Key) -> RedisPipeline: ...

    def hdel(self, name: Key, *keys: Key) -> RedisPipeline: ...

    def hset(
        self,
        name: Key,
        key: Key | None = None,
        value: Value | None = None,
        mapping: Mapping[str, Value] | None = None,
    ) -> RedisPipeline: ...

    def hincrby(self, name: Key, key: Key, amount: int = 1) -> RedisPipeline: ...

    def incr(self, name: Key, amount: int = 1) -> RedisPipeline: ...

    def llen(self, name: Key) -> RedisPipeline: ...

    def lpos(self, name: Key, value: Value) -> RedisPipeline: ...

    def rpush(self, name: Key, *values: Value) -> RedisPipeline: ...

    def blmove(
        self,
        first_list: Key,
        second_list: Key,
        timeout: float,
        src: str = "LEFT",
        dest: str = "RIGHT",
    ) -> RedisPipeline: ...

    def fcall(self, function: str, numkeys: int, *keys_and_args: Any) -> RedisPipeline: ...

    def xreadgroup(  # no BLOCK: one command that waits would hold the pipeline's others
        self, groupname: Key, consumername: Key, streams: Mapping[Any, Any], count: int
    ) -> RedisPipeline: ...

    def sadd(self, name: Key, *values: Value) -> RedisPipeline: ...

    def srem(self, name: Key, *values: Value) -> RedisPipeline: ...

    def zadd(self, name: Key, mapping: Mapping[Key, float]) -> RedisPipeline: ...

    def zrem(self, name: Key, *values: Value) -> RedisPipeline: ...

    def zremrangebyscore(self, name: Key, min: float | str, max: float | str) -> RedisPipeline: ...

    def zcount(self, name: Key, min: float | str, max: float | str) -> RedisPipeline: ...

    def zrange(self, name: Key, start: int, end: int) -> RedisPipeline: ...

    def hkeys(self, name: Key) -> RedisPipeline: ...

    def xadd(
        self,
        name: Key,
        fields: Mapping[Any, Any],
        id: Key = "*",
        maxlen: int | None = None,
        approximate: bool = True,
    ) -> RedisPipeline: ...

    def xlen(self, name: Key) -> RedisPipeline: ...

    def xrange(
        self, name: Key, min: Key = "-", max: Key = "+", count: int | None = None
    ) -> RedisPipeline: ...

    def xtrim(
        self,
        name: Key,
        maxlen: int | None = None,
        approximate: bool = True,
        minid: Key | None = None,
        limit: int | None = None,
    ) -> RedisPipeline: ...

    def xpending_range(
        self,
        name: Key,
        groupname: Key,
        min: Key,
        max: Key,
        count: int,
        consumername: Key | None = None,
        idle: int | None = None,
    ) -> RedisPipeline: ...


class RedisClient(Protocol):
    """An asyncio Redis, Redis Cluster or sentinel-managed client with bytes replies: the
    commands batchline sends, each a coroutine."""

    async def aclose(self) -> None: ...

    async def ping(self) -> bool: ...

    def pipeline(self, transaction: bool = True) -> RedisPipeline: ...

    async def execute_command(self, *args: Any, **options: Any) -> Any: ...

    async def get(self, name: Key) -> bytes | None: ...

    async def set(
        self,
        name: Key,
        value: Value,
        ex: int | None = None,
        px: int | None = None,
        nx: bool = False,
        xx: bool = False,
    ) -> bool | None: ...

    async def delete(self, *names: Key) -> int: ...

    async def hget(self, name: Key, key: Key) -> bytes | None: ...

    async def hgetall(self, name: Key) -> dict[bytes, bytes]: ...
    async def hvals(self, name: Key) -> list[bytes]: ...

    async def llen(self, name: Key) -> int: ...

    async def lrange(self, name: Key, start: int, end: int) -> list[bytes]: ...

    async def blmove(
        self,
        first_list: Key,
        second_list: Key,
        timeout: float,
        src: str = "LEFT",
        dest: str = "RIGHT",
    ) -> bytes | None: ...

    async def scard(self, name: Key) -> int: ...

    async def smembers(self, name: Key) -> Members: ...

    async def smismember(self, name: Key, values: Sequence[Value]) -> list[int]: ...

    async def zcount(self, name: Key, min: float | str, max: float | str) -> int: ...

    async def zrange(
        self, name: Key, start: int, end: int, desc: bool = False, withscores: bool = False
    ) -> list[Any]: ...

    async def zrevrange(
        self, name: Key, start: int, end: int, withscores: bool = False
    ) -> list[Any]: ...

    async def zrangebyscore(
        self,
        name: Key,
        min: float | str,
        max: float | str,
        start: int | None = None,
        num: int | None = None,
        withscores: bool = False,
    ) -> list[Any]: ...

    async def zrank(self, name: Key, value: Value) -> int | None: ...

    async def zrevrank(self, name: Key, value: Value) -> int | None: ...

    async def zrem(self, name: Key, *values: Value) -> int: ...

    async def xlen(self, name: Key) -> int: ...

    async def xadd(
        self, name: Key, fields: Mapping[Any, Any], id: Key = "*", nomkstream: bool = False
    ) -> bytes | None: ...

    async def xrange(
        self, name: Key, min: Key = "-", max: Key = "+", count: int | None = None
    ) -> list[Any]: ...

    async def xdel(self, name: Key, *ids: Key) -> int: ...

    async def xread(
        self,
        streams: Mapping[Any, Any],
        count: int | None = None,
        block: int | None = None,
    ) -> Any: ...

    async def xreadgroup(
        self,
        groupname: Key,
        consumername: Key,
        streams: Mapping[Any, Any],
        count: int | None = None,
        block: int | None = None,
        noack: bool = False,
    ) -> Any: ...

    async def xrevrange(
        self, name: Key, max: Key = "+", min: Key = "-", count: int | None = None
    ) -> list[Any]: ...

    async def xclaim(
        self,
        name: Key,
        groupname: Key,
        consumername: Key,
        min_idle_time: int,
        message_ids: Sequence[Key],
        idle: int | None = None,
        time: int | None = None,
        retrycount: int | None = None,
        force: bool = False,
        justid: bool = False,
    ) -> list[Any]: ...

    async def xautoclaim(
        self,
        name: Key,
        groupname: Key,
        consumername: Key,
        min_idle_time: int,
        start_id: Key = "0-0",
        count: int | None = None,
        justid: bool = False,
    ) -> list[Any]: ...

    async def xpending_range(
        self,
        name: Key,
        groupname: Key,
        min: Key,
        max: Key,
        count: int,
        consumername: Key | None = None,
        idle: int | None = None,
    ) -> list[dict[str, Any]]: ...

    async def xinfo_groups(self, name: Key) -> list[dict[str, Any]]: ...

    async def xgroup_create(
        self, name: Key, groupname: Key, id: Key = "$", mkstream: bool = False
    ) -> bool: ...

    async def wait(self, num_replicas: int, timeout: int) -> int: ...

    async def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> Any: ...

    async def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any: ...

    async def fcall(self, function: str, numkeys: int, *keys_and_args: Any) -> Any: ...

    async def script_load(self, script: str) -> str: ...

    async def function_load(self, code: str, replace: bool = False) -> str: ...

    def scan_iter(
        self, match: str | None = None, count: int | None = None
    ) -> AsyncIterator[bytes]: ...


#: What a caller may hand batchline as its client (a ``redis=`` argument): a redis-py
#: asyncio client it made itself (bytes replies), or one :func:`batchline.transport.connect`
#: made.
RedisArgument = Redis | RedisCluster | RedisClient
