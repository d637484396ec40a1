"""What the scale-out and security tests share (test_cluster.py, test_security.py, and the
ACL tests of test_acl_web.py and test_stream.py): a redis-server started for one test,
in-process workers, a round trip through a queue, and the producer and worker ACL users.

Workers run in this process (a thread each, as in conftest's start_worker); waiting is
bounded (wait_until, timeouts).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from batchline.acl import ROLES, Role, acl_rules
from batchline.errors import QueueFull
from batchline.keys import GROUP, QueueKeys
from batchline.producer import AsyncProducer
from batchline.worker import Worker

from .service import RESULT_TIMEOUT_S, WorkerThread, _stop_process, spec, stop_all, wait_until

T = RESULT_TIMEOUT_S
N = 200


def _start_server(
    binary: str, workdir: Path, name: str, args: list[str], ready: Callable[[], bool]
) -> subprocess.Popen[bytes]:
    """Start one redis-server with ``args``; wait (bounded) until ``ready()``."""
    log_path = workdir / f"{name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            + ["--dir", str(workdir), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 20.0
    while proc.poll() is None and time.monotonic() < deadline:
        if ready():
            return proc
        time.sleep(0.02)
    _stop_process(proc)
    raise RuntimeError(f"redis-server {name} did not start; its log:\n{log_path.read_text()}")


def _pings(client_factory: Callable[[], redis.Redis]) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            client = client_factory()
            try:
                return bool(client.ping())
            finally:
                client.close()
        except (redis.RedisError, OSError):
            return False

    return ready


@pytest.fixture
def workers() -> Iterator[Callable[..., WorkerThread]]:
    """Start in-process workers with any settings; all are stopped at the end of the test."""
    started: list[WorkerThread] = []

    def start(**settings: Any) -> WorkerThread:
        thread = WorkerThread(Worker(model=spec("echo"), **{"heartbeat_s": 0.2, **settings}))
        started.append(thread)
        thread.start()
        return thread

    yield start
    stop_all(started)


async def _round_trip(
    client: Any, keys: QueueKeys, producer_settings: dict[str, Any], worker_id: str
) -> None:
    """Map N requests through a running worker; a polled result; TTLs of the result and
    reply keys; empty work streams; the reply stream gone after close. ``client`` (a
    blocking client of the same server or cluster) looks at the keys."""
    async with AsyncProducer(**producer_settings) as producer:
        values = [f"{keys.queue}-{i}" for i in range(N)]
        assert await producer.map(values, timeout_s=T) == values
        handle = await producer.submit("polled", reply=False)
        deadline = time.monotonic() + T
        while (found := await producer.get_result(handle.id)) is None:
            assert time.monotonic() < deadline, "no result to poll"
            await asyncio.sleep(0.02)
        assert (found.status, found.output, found.worker) == ("ok", "polled", worker_id)
        assert await producer.get_result("never-submitted") is None
        ttl = int(producer_settings.get("result_ttl_s", 3600))
        assert 0 < client.ttl(keys.result(handle.id)) <= ttl
        assert 0 < client.ttl(keys.reply(producer.producer_id)) <= ttl
        wait_until(
            lambda: [client.xlen(s) for s in keys.streams] == [0] * keys.priorities,
            "the work streams to be empty",
            timeout_s=T,
        )
        assert await producer.queue_depth() == 0
        reply_key = keys.reply(producer.producer_id)
    assert not client.exists(reply_key), "the producer left its reply stream behind"


async def _queue_full_then_served(
    producer_settings: dict[str, Any], start: Callable[[], WorkerThread]
) -> WorkerThread:
    """With no worker yet: 5 accepted, the 6th refused; then a worker serves the 5."""
    async with AsyncProducer(**{**producer_settings, "max_queue_depth": 5}) as producer:
        handles = [await producer.submit(i, priority=i % 3) for i in range(5)]
        with pytest.raises(QueueFull, match="max_queue_depth=5"):
            await producer.submit(5)
        assert await producer.queue_depth() == 5
        thread = start()
        assert [await producer.result(h, timeout_s=T) for h in handles] == list(range(5))
    return thread


PREFIX = "myprefix"


@contextlib.contextmanager
def named_acl_users(
    redis_url: str, tag: str, rules: dict[str, list[str]]
) -> Iterator[dict[str, str]]:
    """Users ``blq-<name>-<tag>`` with these rules on the server of ``redis_url`` (skipped
    below Redis 7: selectors and read-only key patterns): each name's URL; deleted on
    leaving."""
    admin = redis.Redis.from_url(redis_url)
    try:
        if int(str(admin.info("server")["redis_version"]).split(".")[0]) < 7:
            pytest.skip("selectors and read-only key patterns need Redis 7")
        urls = {}
        for name, granted in rules.items():
            user = f"blq-{name}-{tag}"
            admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">pw-{user}", *granted)
            urls[name] = redis_url.replace("redis://", f"redis://{user}:pw-{user}@")
        yield urls
    finally:
        for name in rules:
            admin.execute_command("ACL", "DELUSER", f"blq-{name}-{tag}")
        admin.close()


def _acl_users(
    admin: redis.Redis, redis_url: str, keys: QueueKeys, tag: str
) -> dict[Role, tuple[str, str]]:
    """Create the producer and the worker user of ``keys`` (batchline.acl's rules) on the
    server of ``admin``; return each role's URL and password. Skips below Redis 7."""
    version = str(admin.info("server")["redis_version"])
    if int(version.split(".", maxsplit=1)[0]) < 7:
        pytest.skip(f"redis-server {version}: read-only key patterns and selectors need Redis 7")
    out: dict[Role, tuple[str, str]] = {}
    for role in ROLES:
        user, password = f"blq-{role}-{tag}", f"blq-secret-{role}-{tag}"
        admin.execute_command(
            "ACL", "SETUSER", user, "reset", "on", f">{password}", *acl_rules(keys, role)
        )
        out[role] = (redis_url.replace("redis://", f"redis://{user}:{password}@"), password)
    return out


def _forging_is_refused(client: redis.Redis, keys: QueueKeys, victim: str, rid: str) -> None:
    """Every way a producer could make another producer or a poller accept a result no
    worker wrote, or learn the ids and reply addresses to aim at, gets NOPERM."""
    refused = [
        lambda: client.xadd(keys.stream(0), {"x": "y"}, maxlen=0),
        lambda: client.xadd(keys.cancels, {"id": rid}, maxlen=0),
        lambda: client.lpop(keys.inbox),
        lambda: client.ltrim(keys.inbox, 0, 0),
        lambda: client.delete(keys.inbox),
        lambda: client.eval("while true do end", 0),
        lambda: client.get(keys.reply(victim)),
        lambda: client.xadd(keys.reply(victim), {"n": 1, "r": b"forged"}),
        lambda: client.set(keys.result(rid), b"forged"),
        lambda: client.delete(keys.result(rid)),
        lambda: client.expire(keys.result(rid), 1),
        lambda: client.xrange(keys.stream(0)),
        lambda: client.xrevrange(keys.stream(0)),
        lambda: client.xread({keys.stream(0): "0"}),
        lambda: client.xreadgroup(GROUP, "thief", {keys.stream(0): ">"}),
        lambda: client.xreadgroup(GROUP, "thief", {keys.stream(0): "0"}),
        lambda: client.xinfo_stream(keys.stream(0)),
        lambda: client.xpending_range(keys.stream(0), GROUP, "-", "+", 10),
        lambda: client.xclaim(keys.stream(0), GROUP, "thief", 0, ["0-1"]),
        lambda: client.xautoclaim(keys.stream(0), GROUP, "thief", 0),
        lambda: client.xack(keys.stream(0), GROUP, "0-1"),
        lambda: client.expire(keys.stream(0), 1),
        lambda: client.delete(keys.stream(0)),
        lambda: client.xadd(keys.dead, {"forged": 1}),
        lambda: client.xrange(keys.dead),
        lambda: client.zadd(keys.workers, {"fake": time.time()}),
        lambda: client.zrem(keys.workers, "any"),
        lambda: client.zrange(keys.workers, 0, -1),  # who the workers are: only how many
        lambda: client.zrangebyscore(keys.workers, 0, "+inf"),
        lambda: client.set(keys.worker_stats("fake"), b"{}"),
        lambda: client.xread({keys.cancels: "0"}),
        lambda: client.eval(
            "return redis.call('XADD', KEYS[1], '*', 'n', 1, 'r', 'x')", 1, keys.reply(victim)
        ),
        lambda: client.eval(
            "return redis.call('SET', ARGV[1], 'x')", 1, keys.stream(0), keys.result(rid)
        ),
        lambda: client.eval("return redis.call('XRANGE', KEYS[1], '-', '+')", 1, keys.stream(0)),
        lambda: client.set("otherprefix:x", "1"),
        client.flushdb,
        # Keys the admission writes: job keys, the counters, the functions' tag; and the
        # inbox's elements (every request's id and reply) are not a producer's to read.
        lambda: client.set(keys.job(rid), "x" * 1000),
        lambda: client.delete(keys.job(rid)),
        lambda: client.hincrby(keys.once_stats, "hit", 10**9),
        lambda: client.expire(keys.once_stats, 1),
        lambda: client.set(keys.functions, "forged"),
        lambda: client.lrange(keys.inbox, 0, -1),
        lambda: client.lindex(keys.admitting, 0),
    ]
    for call in refused:  # (pytest -l shows which one a failure is)
        # NoPermissionError, or a ResponseError when refused inside a script.
        with pytest.raises(redis.ResponseError, match="no permissions|user executing the script"):
            call()
