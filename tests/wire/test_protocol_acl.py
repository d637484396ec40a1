"""The ACL rule set of docs/protocol.md, applied verbatim: a producer and a worker under it
answer, cancel, and get past an idle connection's health-check PING; nothing outside the
prefix is allowed; and the rules the doc says are needed are needed."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

import pytest
import redis

from batchline.errors import RequestCancelled
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer

from tests.support.service import (
    REPO,
    RESULT_TIMEOUT_S,
    WorkerThread,
    pending_count,
    poll_result,
    wait_until,
)

T = RESULT_TIMEOUT_S
DOC = (REPO / "docs" / "protocol.md").read_text(encoding="utf-8")


def documented_rules() -> list[str]:
    """The rules of the doc's ``ACL SETUSER batchline ...`` line, password left as PASSWORD."""
    found = re.search(r"```acl\nACL SETUSER batchline (.*?)\n```", DOC)
    assert found is not None, "no ACL SETUSER line in docs/protocol.md"
    return found.group(1).split()


def denials(client: redis.Redis, url: str) -> list[Any]:
    user = url.split("//")[1].split(":", maxsplit=1)[0]
    return [e for e in client.acl_log() if e.get("username") == user]


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
    assert denials(rclient, url) == []
