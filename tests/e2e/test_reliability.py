"""Real processes: many producers and workers, a worker killed mid-batch, a request that
kills every worker that takes it, and a SIGTERM drain. Every request is answered, once."""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from batchline.codec import Result
from batchline.config import WebSettings, WorkerSettings
from batchline.errors import InferenceError
from batchline.keys import QueueKeys
from batchline.producer import Producer

from tests.support.models_for_tests import CRASH_EXIT_CODE, read_batches
from tests.support.reply_spy import count_replies
from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerProcess,
    pending_count,
    producer_reports,
    spec,
    start_producers,
    stop_producers,
    stream_lengths,
    wait_until,
)

pytestmark = pytest.mark.slow  # real worker and producer processes, several at once

T = RESULT_TIMEOUT_S
HUGE_MS = 600_000


def assert_all_done(client: redis.Redis, keys: QueueKeys) -> None:
    assert stream_lengths(client, keys) == [0] * keys.priorities
    assert pending_count(client, keys) == 0


def test_many_producers_and_workers_answer_every_request_once(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    workers = [
        spawn_worker(spec("double"), batch_size=8, ready=False, claim_idle_ms=2000)
        for _ in range(3)
    ]
    for worker in workers:
        worker.wait_ready(rclient, keys)
    producers = start_producers(redis_url, queue, [[f"p{n}", "150"] for n in range(4)])
    try:
        served: Counter[str] = Counter()
        for report in producer_reports(producers):
            assert report["wrong"] == []
            served.update(report["workers"])
        assert sum(served.values()) == 600
        assert set(served) <= {w.worker_id for w in workers}
        for worker in workers:  # no reply can be written after this
            worker.signal(signal.SIGTERM)
        for worker in workers:
            assert worker.wait() == 0, worker.log()
        for report in producer_reports(producers, final=True):
            assert report == {"left": 0, "missing": [], "twice": {}, "strangers": []}
    finally:
        stop_producers(producers)
    assert_all_done(rclient, keys)
    assert rclient.xlen(keys.dead) == 0


def test_a_worker_killed_mid_batch_loses_nothing(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    tmp_path: Path,
) -> None:
    record = tmp_path / "first-worker.jsonl"
    with Producer(redis_url=redis_url, queue=queue) as producer:
        replies = count_replies(producer)
        # All queued before the first worker starts, so that its first batch is a full one.
        handles = [producer.submit(i) for i in range(8)]
        first = spawn_worker(
            spec("slow"),
            env={"BLTEST_SLOW_S": "600", "BLTEST_RECORD_FILE": str(record)},
            batch_size=4,
            claim_idle_ms=500,
        )
        wait_until(lambda: read_batches(record), "the first worker to start a batch")
        wait_until(lambda: pending_count(rclient, keys) == 8, "the first worker to hold all 8")
        first.signal(signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL
        second = spawn_worker(spec("echo"), batch_size=4, claim_idle_ms=500)
        results = [producer.wait(h, timeout_s=T) for h in handles]
        assert [(r.status, r.output) for r in results] == [("ok", i) for i in range(8)]
        assert {r.worker for r in results} == {second.worker_id}
        assert_all_done(rclient, keys)
    assert replies == Counter({h.id: 1 for h in handles})
    assert [len(batch) for batch in read_batches(record)] == [4]  # it died in its first batch
    # Logged once the reclaimer has taken every entry over, which may be after the answers.
    wait_until(lambda: "reclaimed" in second.log(), "the second worker to log its reclaim")


def test_with_the_default_settings_a_killed_workers_requests_beat_the_callers_timeout(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    tmp_path: Path,
) -> None:
    """A worker killed (OOM, a node lost) holds requests nobody answers until another
    worker reclaims them after ``claim_idle_ms``: by default that comes well within the
    time the HTTP API waits by default (``request_timeout_s``), so its callers are
    answered, not given 504s."""
    record = tmp_path / "first-worker.jsonl"
    wait_s = WebSettings().request_timeout_s
    assert WorkerSettings().claim_idle_ms / 1e3 < wait_s / 2
    with Producer(redis_url=redis_url, queue=queue) as producer:
        handles = [producer.submit(i) for i in range(4)]
        sent = time.monotonic()
        first = spawn_worker(
            spec("slow"),
            env={"BLTEST_SLOW_S": "600", "BLTEST_RECORD_FILE": str(record)},
            batch_size=4,
        )
        wait_until(lambda: read_batches(record), "the first worker to start its batch")
        first.signal(signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL
        spawn_worker(spec("echo"), batch_size=4)
        results = [
            producer.wait(h, timeout_s=max(0.1, sent + wait_s - time.monotonic())) for h in handles
        ]
        assert [(r.status, r.output) for r in results] == [("ok", i) for i in range(4)]


def test_a_request_that_kills_every_worker_is_dead_lettered(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    tmp_path: Path,
) -> None:
    record = tmp_path / "batches.jsonl"
    # One request per batch and no read-ahead beyond it, so that a crash takes down as few
    # innocent requests as possible; max_deliveries=2: two crashes, then the dead letter.
    settings = dict(batch_size=1, read_ahead=1, claim_idle_ms=500, max_deliveries=2)
    with Producer(redis_url=redis_url, queue=queue) as producer:
        replies = count_replies(producer)
        killer = producer.submit("crash")
        others = [producer.submit(f"ok-{i}") for i in range(20)]
        workers = [
            spawn_worker(
                spec("crash"), env={"BLTEST_RECORD_FILE": str(record)}, ready=False, **settings
            )
            for _ in range(3)
        ]
        result = producer.wait(killer, timeout_s=T)
        assert (result.status, result.error_type) == ("error", "MaxDeliveries")
        with pytest.raises(InferenceError, match="max_deliveries=2"):
            producer.result(killer)
        outputs = [producer.result(h, timeout_s=T) for h in others]
        assert outputs == [f"ok-{i}" for i in range(20)]
        assert_all_done(rclient, keys)
    # Each crash killed a worker process, which its supervisor replaced: all still serve.
    assert all(w.proc.poll() is None for w in workers)
    logs = "".join(w.log() for w in workers)
    assert logs.count(f"died (status {CRASH_EXIT_CODE}); restarting") == 2
    seen = Counter(x for batch in read_batches(record) for x in batch)
    assert seen["crash"] == 2  # delivered twice, then dead-lettered without running
    dead = rclient.xrange(keys.dead)
    assert len(dead) == 1
    assert dead[0][1][b"reason"].startswith(b"MaxDeliveries: ")
    assert dead[0][1][b"id"] == killer.id.encode()
    assert set(replies) == {killer.id, *(h.id for h in others)}
    assert set(replies.values()) == {1}


def test_sigterm_drains_what_the_worker_holds_and_exits_cleanly(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    tmp_path: Path,
) -> None:
    record = tmp_path / "batches.jsonl"
    with Producer(redis_url=redis_url, queue=queue) as producer:
        # Six requests wait before the worker starts: it reads them all at once, runs a
        # batch of four (slowly), and holds two (a partial batch, never due by its timeout).
        handles = [producer.submit(i) for i in range(6)]
        worker = spawn_worker(
            spec("slow"),
            env={"BLTEST_SLOW_S": "2", "BLTEST_RECORD_FILE": str(record)},
            batch_size=4,
            timeout_ms=HUGE_MS,
        )
        wait_until(lambda: read_batches(record), "the first batch to start")
        assert pending_count(rclient, keys) == 6
        worker.signal(signal.SIGTERM)
        assert worker.wait() == 0, worker.log()
        # The results were written before the worker exited.
        stored = [producer.get_result(h.id) for h in handles]
        assert all(isinstance(r, Result) for r in stored)
        assert [r.output for r in stored if r is not None] == list(range(6))
        assert [producer.result(h, timeout_s=T) for h in handles] == list(range(6))
    assert [sorted(batch) for batch in read_batches(record)] == [[0, 1, 2, 3], [4, 5]]
    assert_all_done(rclient, keys)
    assert rclient.zscore(keys.workers, worker.worker_id) is None  # it signed off
    assert f"worker {worker.worker_id}: stopped" in worker.log()
