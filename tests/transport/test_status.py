"""``batchline status --json`` reports the figures an autoscaler (KEDA) reads, per stream.

KEDA's ``redis-streams`` trigger reads ``XINFO GROUPS`` ``lag`` (``lagCount``) or ``XPENDING``
(``pendingEntriesCount``) of the consumer group; the status must show the same numbers, read
from Redis directly here, including the cases where they differ from the work left.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from batchline.keys import GROUP, QueueKeys
from batchline.producer import Producer

from tests.support.models_for_tests import GatedModel
from tests.support.service import WorkerThread, pending_count, run_cli, wait_until

HUGE_MS = 600_000.0  # batches flush by size only


def raw_group(client: redis.Redis, stream: str) -> tuple[Any, int]:
    """The group's lag (XINFO GROUPS) and pending count (XPENDING), straight from Redis."""
    (group,) = [g for g in client.xinfo_groups(stream) if g["name"].decode() == GROUP]
    return group["lag"], int(client.xpending(stream, GROUP)["pending"])


def status(redis_url: str, queue: str) -> dict[int, dict[str, Any]]:
    env = {"BATCHLINE_REDIS_URL": redis_url, "BATCHLINE_QUEUE": queue}
    done = run_cli("status", "--json", env=env)
    assert done.returncode == 0, done.stderr
    return {s["priority"]: s for s in json.loads(done.stdout)["streams"]}


@pytest.mark.slow
def test_lag_and_pending_match_xinfo_and_xpending(
    rclient: redis.Redis, keys: QueueKeys, redis_url: str, queue: str
) -> None:
    stream = keys.stream(1)
    rclient.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for i in range(10):
        rclient.xadd(stream, {"n": str(i)})
    # A consumer reads 4 ahead without acknowledging: pending, no longer lag.
    rclient.xreadgroup(GROUP, "reader", {stream: ">"}, count=4)
    lag, pending = raw_group(rclient, stream)
    assert (lag, pending) == (6, 4)
    got = status(redis_url, queue)[1]
    assert (got["lag"], got["pending"], got["backlog"], got["length"]) == (6, 4, 10, 10)
    assert got["consumers"] == 1
    # No group yet on another priority: nothing to report, not zero.
    assert (status(redis_url, queue)[0]["lag"], status(redis_url, queue)[0]["pending"]) == (
        None,
        None,
    )


def test_lag_is_null_after_a_delete_past_the_last_delivered_entry(
    rclient: redis.Redis, keys: QueueKeys, redis_url: str, queue: str
) -> None:
    """Redis cannot count the lag then (redis issues #13337, #13957): status says null."""
    stream = keys.stream(2)
    rclient.xgroup_create(stream, GROUP, id="0", mkstream=True)
    ids = [rclient.xadd(stream, {"n": str(i)}) for i in range(6)]
    rclient.xreadgroup(GROUP, "reader", {stream: ">"}, count=2)
    rclient.xdel(stream, ids[4])  # after the last delivered id, before the end
    lag, pending = raw_group(rclient, stream)
    assert (lag, pending) == (None, 2)
    got = status(redis_url, queue)[2]
    assert (got["lag"], got["pending"], got["backlog"]) == (None, 2, None)


@pytest.mark.slow
def test_a_worker_holding_read_ahead_work_shows_it_as_pending_not_lag(
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    redis_url: str,
    queue: str,
) -> None:
    gate = GatedModel()
    start_worker(gate, batch_size=2, read_ahead=2, timeout_ms=HUGE_MS, heartbeat_s=0.2)
    stream = keys.stream(1)
    with Producer(redis_url=redis_url, queue=queue) as producer:
        handles = [producer.submit(i, priority=1) for i in range(40)]
        assert gate.entered.wait(30), "no batch reached the model"
        # The worker holds the batch in the model (2) and read_ahead x batch_size (4) more:
        # pending; the rest is lag.
        wait_until(lambda: pending_count(rclient, keys) == 6, "the worker to read ahead")
        lag, pending = raw_group(rclient, stream)
        got = status(redis_url, queue)[1]
        assert (got["lag"], got["pending"]) == (lag, pending)
        assert (lag, pending) == (34, 6)
        assert got["backlog"] == 40
        gate.release.set()
        assert [producer.result(h, timeout_s=30) for h in handles] == list(range(40))
    lag, pending = raw_group(rclient, stream)
    got = status(redis_url, queue)[1]
    assert (got["lag"], got["pending"], got["backlog"]) == (lag, pending, 0) == (0, 0, 0)


@pytest.mark.slow
def test_the_text_status_reads_as_words_not_python_literals(
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    redis_url: str,
    queue: str,
) -> None:
    """No ``None``, no dict like ``{'ok': 3}``: a lag Redis cannot count, a priority no worker
    has read and a worker's answers per status, in words; ``--json`` keeps the nulls."""
    thread = start_worker(heartbeat_s=3.0)  # its statistics live 3 heartbeats: 9 s
    worker_id = thread.worker.worker_id
    with Producer(redis_url=redis_url, queue=queue) as producer:
        assert producer.map(["a", "b", "c"], timeout_s=30) == ["a", "b", "c"]
    wait_until(
        lambda: (
            "ok"
            in json.loads(rclient.get(keys.worker_stats(worker_id)) or "{}").get("requests", {})
        ),
        "the worker to publish its answers",
    )
    thread.stop()  # so that it reads none of what follows; then alive again, for status
    rclient.zadd(keys.workers, {worker_id: time.time()})
    # Priority 2: a lag Redis cannot count (an entry deleted after the last delivered one).
    stream = keys.stream(2)
    ids = [rclient.xadd(stream, {"n": str(i)}) for i in range(4)]
    rclient.xreadgroup(GROUP, "reader", {stream: ">"}, count=1)
    rclient.xdel(stream, ids[2])
    rclient.xgroup_destroy(keys.stream(0), GROUP)  # priority 0: no group
    env = {"BATCHLINE_REDIS_URL": redis_url, "BATCHLINE_QUEUE": queue}
    done = run_cli("status", env=env)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    for literal in ("None", "{", "}", "'", "null"):
        assert literal not in text, (literal, text)
    assert "answered 3 ok" in text, text
    assert "lag unknown (entries were deleted after the last read)" in text, text
    assert "priority 0: length 0, no consumer group yet" in text, text
    by_priority = status(redis_url, queue)
    assert by_priority[2]["lag"] is None
    assert by_priority[0]["pending"] is None
