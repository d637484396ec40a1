"""What counts as Redis failing (batchline/transport/_errors.py): redis-py's errors, the
states Redis leaves by itself whatever redis-py makes of their codes, and any exception
raised from inside redis-py's own code; and that batchline's own errors do not count.

The library's failure here is redis-py's, not a fake: an asyncio connection whose writer is
gone (a failover closed it under a command) raises ``AttributeError: 'NoneType' object has no
attribute 'writelines'`` from redis/asyncio/connection.py, as a cluster client's reconnect
did in the cluster failover test."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from redis.asyncio import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from batchline.errors import ServiceUnavailable
from batchline.transport import (
    RedisLibraryError,
    _errors,
    ignoring_redis_failures,
    nothing_queued,
    passing,
    passing_code,
    redis_failure,
)
from batchline.transport._redis import Backoff, _Pinned, _stream_keys
from batchline.worker.upkeep._upkeep import every


async def library_bug() -> None:
    """Raise what redis-py raises writing to a connection closed under it."""
    await Connection()._send_packed_command([b"*1\r\n$4\r\nPING\r\n"])


def batchline_bug() -> None:
    """Raise a programming error from inside batchline's own code."""
    _stream_keys(None)  # type: ignore[arg-type]


async def caught(call: Any) -> BaseException:
    try:
        result = call()
        if asyncio.iscoroutine(result):
            await result
    except BaseException as exc:
        return exc
    raise AssertionError("nothing raised")


async def test_an_error_raised_inside_redis_py_is_a_lost_connection(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_errors, "_LIBRARY_PLACES", set())  # as in a process just started
    bug = await caught(library_bug)
    assert isinstance(bug, AttributeError)
    with caplog.at_level(logging.WARNING, "batchline.transport._errors"):
        failure = redis_failure(bug)
        again = redis_failure(await caught(library_bug))
    assert isinstance(failure, RedisLibraryError)
    assert isinstance(failure, RedisConnectionError)  # a write it carried is uncertain
    assert failure.__cause__ is bug
    assert str(failure) == "AttributeError inside redis-py: " + str(bug)
    assert "'NoneType' object has no attribute 'writelines'" in str(failure)
    assert isinstance(again, RedisLibraryError)
    # Logged with its traceback, once for that place in redis-py.
    logged = [r for r in caplog.records if "from inside its own code" in r.getMessage()]
    assert len(logged) == 1
    assert "redis/asyncio/connection.py" in logged[0].getMessage()
    assert logged[0].exc_info is not None
    assert logged[0].exc_info[1] is bug


async def test_errors_of_batchline_or_of_the_caller_are_not_redis_failures() -> None:
    assert redis_failure(await caught(batchline_bug)) is None
    assert redis_failure(await caught(lambda: {}["key"])) is None  # no redis frame at all
    # batchline code that redis-py calls back: the error is batchline's.
    retry = Retry(NoBackoff(), 0)
    in_callback = await caught(lambda: retry.call_with_retry(batchline_bug, lambda _e: None))
    assert isinstance(in_callback, TypeError)
    assert redis_failure(in_callback) is None
    assert redis_failure(asyncio.CancelledError()) is None
    assert redis_failure(KeyboardInterrupt()) is None
    for failure in (RedisError("x"), ConnectionResetError(), ResponseError("WRONGTYPE x")):
        assert redis_failure(failure) is failure


def test_the_passing_states_are_known_by_redis_pys_types_and_by_their_codes() -> None:
    # redis-py cuts the code from the message of the errors it types.
    parse = Connection()._parser.parse_error
    for reply, code in [
        ("CLUSTERDOWN The cluster is down", "CLUSTERDOWN"),
        ("TRYAGAIN Multiple keys request during rehashing of slot", "TRYAGAIN"),
        ("MASTERDOWN Link with MASTER is down", "MASTERDOWN"),
        ("READONLY You can't write against a read only replica.", "READONLY"),
        ("LOADING Redis is loading the dataset in memory", "LOADING"),
        ("OOM command not allowed when used memory > 'maxmemory'.", "OOM"),
        ("NOREPLICAS Not enough good replicas to write.", "NOREPLICAS"),
        ("ERR Error running script: @user_script:13: -MISCONF no disk", "MISCONF"),
    ]:
        error = parse(reply)
        assert code not in str(error) or code in ("NOREPLICAS", "MISCONF"), error
        assert passing_code(error) == code, reply
        assert passing(error)
    for reply in ("WRONGTYPE Operation against a key", "NOPERM no rights", "ERR unknown"):
        assert passing_code(parse(reply)) is None
    assert not passing(RedisConnectionError("gone"))
    # The producer's typed error for a write refused so.
    assert isinstance(nothing_queued(ClusterDownError("The cluster is down")), ServiceUnavailable)


async def test_backoff_retry_rides_out_the_librarys_own_failure() -> None:
    calls = 0

    async def attempt() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            await library_bug()
        return "written"

    retry = Backoff(logging.getLogger("test"), "writer", max_delay_s=0.05)
    assert await retry.retry(attempt, budget_s=30.0) == "written"
    assert calls == 3

    async def bug() -> None:
        batchline_bug()

    with pytest.raises(TypeError):
        await retry.retry(bug, budget_s=30.0)


async def test_a_periodic_loop_survives_the_library_and_stops_on_batchline_bugs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    steps = 0

    async def step() -> None:
        nonlocal steps
        steps += 1
        if steps < 3:
            await library_bug()
        else:
            batchline_bug()

    with caplog.at_level(logging.WARNING), pytest.raises(TypeError):
        await every(0, "janitor", step, lambda: False)
    assert steps == 3
    assert "janitor: RedisLibraryError: AttributeError inside redis-py" in caplog.text


async def test_ignoring_redis_failures_drops_the_librarys_and_not_batchlines() -> None:
    with ignoring_redis_failures():
        await library_bug()
    with ignoring_redis_failures():
        raise RedisConnectionError("gone")
    with pytest.raises(TypeError), ignoring_redis_failures():
        batchline_bug()


async def test_a_pinned_node_connection_is_dropped_after_the_librarys_failure() -> None:
    # Durability replicated on a cluster: the writes' connection to the queue's node. After
    # redis-py failed on it, the next call finds the node again (a failover may have moved it).
    class Nodes:
        initialized = 0

        async def initialize(self) -> None:
            self.initialized += 1

    class Pool:
        async def disconnect(self) -> None:
            return None

    class NodeClient:
        connection_pool = Pool()

        async def get(self, key: str) -> None:
            await library_bug()

        async def aclose(self) -> None:
            return None

    cluster: Any = type("Cluster", (), {"nodes_manager": Nodes()})()
    pinned = _Pinned(cluster, "{q}:in")
    pinned._client = NodeClient()  # type: ignore[assignment]
    with pytest.raises(AttributeError):
        await pinned.get("{q}:in")
    assert pinned._client is None
    assert cluster.nodes_manager.initialized == 1
