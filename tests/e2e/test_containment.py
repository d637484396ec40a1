"""Containment: a model that crashes its process, or hangs, on one input takes only that
input down. Real Redis, real ``batchline worker`` processes (a supervisor and its child)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from batchline.errors import WorkerHung
from batchline.keys import GROUP, QueueKeys
from batchline.producer import Producer

from .test_reliability import assert_all_done
from tests.support.models_for_tests import GatedModel, HangsOn, read_batches
from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerProcess,
    WorkerThread,
    admit_inbox,
    pending_count,
    run_cli,
    spec,
    wait_until,
)

T = RESULT_TIMEOUT_S
CLIENT_TIMEOUT_S = 20.0  # what each request of a hang under default settings may wait


def serve_with_one_bad_input(
    producer: Producer,
    start: Callable[[], list[WorkerProcess]],
    inputs: list[Any],
    bad: str,
    client: redis.Redis,
    keys: QueueKeys,
) -> list[WorkerProcess]:
    """Queue ``inputs``, then start the workers: every input but ``bad`` is answered with
    itself, ``bad`` is dead-lettered (MaxDeliveries), and the workers still serve."""
    handles = [producer.submit(x) for x in inputs]  # before the workers: full batches
    workers = start()
    for x, h in zip(inputs, handles, strict=True):
        r = producer.wait(h, timeout_s=T)
        if x == bad:
            assert (r.status, r.error_type) == ("error", "MaxDeliveries")
            dead = client.xrange(keys.dead)
            assert [d[1][b"id"] for d in dead] == [h.id.encode()]
            assert dead[0][1][b"reason"].startswith(b"MaxDeliveries: ")
        else:
            assert (r.status, r.output) == ("ok", x)
    # The supervisors replaced the processes that died: the workers still serve.
    assert all(w.proc.poll() is None for w in workers)
    assert [producer.result(producer.submit(i), timeout_s=T) for i in range(5)] == list(range(5))
    assert_all_done(client, keys)
    return workers


@pytest.mark.parametrize("n_workers", [1, 2])
@pytest.mark.slow
def test_a_process_crash_on_one_input_spares_its_batch_mates(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    tmp_path: Path,
    n_workers: int,
) -> None:
    record = tmp_path / "batches.jsonl"
    inputs = [f"ok-{i}" for i in range(32)]
    inputs[13] = "abort"
    with Producer(redis_url=redis_url, queue=queue) as producer:
        workers = serve_with_one_bad_input(
            producer,
            lambda: [
                spawn_worker(
                    spec("abort"),
                    env={"BLTEST_RECORD_FILE": str(record)},
                    ready=False,
                    batch_size=32,
                    claim_idle_ms=1000,  # a starved test machine must not lapse claims
                    max_deliveries=3,
                )
                for _ in range(n_workers)
            ],
            inputs,
            "abort",
            rclient,
            keys,
        )
    batches = read_batches(record)
    # Delivered three times (max_deliveries), alone after the first, then dead-lettered.
    with_abort = [b for b in batches if "abort" in b]
    assert len(with_abort) == 3
    assert all(b == ["abort"] for b in with_abort[1:])
    logs = "".join(w.log() for w in workers)
    assert logs.count("died (signal 6); restarting") == 3


@pytest.mark.parametrize(
    ("model", "max_batch_ms"),
    [("hang", 1500), ("async_hang", 1000)],
    ids=["plain", "coroutine"],  # async_hang awaits on the event loop, which stays free
)
@pytest.mark.slow
def test_a_hang_on_one_input_is_handed_back_and_dead_lettered(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    tmp_path: Path,
    model: str,
    max_batch_ms: int,
) -> None:
    record = tmp_path / "batches.jsonl"
    inputs: list[object] = list(range(200))
    inputs[5] = "hang"
    settings = dict(
        batch_size=8, read_ahead=8, claim_idle_ms=1000, max_deliveries=2, max_batch_ms=max_batch_ms
    )
    with Producer(redis_url=redis_url, queue=queue) as producer:
        workers = serve_with_one_bad_input(
            producer,
            lambda: [
                spawn_worker(
                    spec(model), env={"BLTEST_RECORD_FILE": str(record)}, ready=False, **settings
                )
                for _ in range(2)
            ],
            inputs,
            "hang",
            rclient,
            keys,
        )
    with_hang = [b for b in read_batches(record) if "hang" in b]
    assert len(with_hang) == 2
    assert with_hang[1] == ["hang"]  # the second time alone
    logs = "".join(w.log() for w in workers)
    assert logs.count(f"past max_batch_ms={max_batch_ms}") == 2
    assert "handed back" in logs
    assert logs.count("died (status 70); restarting") == 2


@pytest.mark.parametrize("draining", [False, True], ids=["serving", "draining"])
@pytest.mark.slow
def test_a_hung_worker_reports_unhealthy_and_hands_back_what_it_read(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    draining: bool,
) -> None:
    model = GatedModel()
    thread = start_worker(
        model=model, batch_size=2, timeout_ms=0, claim_idle_ms=60_000, max_batch_ms=300
    )
    check = ["worker", "--check", "--redis-url", redis_url, "--queue", queue]
    check += ["--worker-id", thread.worker.worker_id]
    assert run_cli(*check).returncode == 0
    try:
        with Producer(redis_url=redis_url, queue=queue) as producer:
            handles = [producer.submit(i) for i in range(6)]
            assert model.entered.wait(T)
            if draining:  # SIGTERM's drain waits for the hung batch: the watchdog ends it
                wait_until(lambda: pending_count(rclient, keys) == 6, "all six to be read")
                thread.worker.stop()
            wait_until(lambda: not thread.alive, "the hung worker to give up")
            assert isinstance(thread.error, WorkerHung)
            thread.error = None  # seen here; the fixture must not raise it again
            done = run_cli(*check)
            assert done.returncode == 1, done.stdout
            assert "unhealthy" in done.stderr
            # Everything it held is pending, idle past claim_idle_ms: any worker takes it now.
            held = [e for p in keys.streams for e in rclient.xpending_range(p, GROUP, "-", "+", 9)]
            assert len(held) == 6
            assert all(e["time_since_delivered"] >= 60_000 for e in held)
            # The hung batch keeps its delivery; the read-ahead is as if never delivered.
            started = len(model.batches[0])
            assert sorted(e["times_delivered"] for e in held) == [0] * (6 - started) + [1] * started
            model.release.set()
            other = start_worker(batch_size=8, claim_idle_ms=300)
            assert [producer.result(h, timeout_s=T) for h in handles] == list(range(6))
            assert other.alive
    finally:
        model.release.set()


@pytest.mark.slow
def test_the_supervisor_gives_up_past_max_restarts_per_min(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
) -> None:
    worker = spawn_worker(
        spec("crash"), batch_size=1, claim_idle_ms=300, max_deliveries=5, max_restarts_per_min=1
    )
    with Producer(redis_url=redis_url, queue=queue) as producer:
        producer.submit("crash")  # kills the first child, and the second when reclaimed
        assert worker.wait() == 1, worker.log()
    log = worker.log()
    assert log.count("restarting in") == 1
    assert "giving up" in log


def test_no_supervisor_with_max_restarts_per_min_0(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    worker = spawn_worker(spec("crash"), batch_size=1, max_restarts_per_min=0)
    stats = rclient.get(keys.worker_stats(worker.worker_id))
    assert stats is not None
    assert json.loads(stats)["pid"] == worker.pid  # the command's own process serves
    with Producer(redis_url=redis_url, queue=queue) as producer:
        producer.submit("crash")
        assert worker.wait() != 0, worker.log()
    assert "restarting in" not in worker.log()


def _held(client: redis.Redis, keys: QueueKeys) -> list[dict[str, Any]]:
    """The entries pending in the queue's group, every priority."""
    return [e for p in keys.streams for e in client.xpending_range(p, GROUP, "-", "+", 1000)]


@pytest.mark.slow
def test_a_hang_under_default_settings_is_bounded_by_the_models_own_speed(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    """Default settings (max_batch_ms auto): the model's warm-up batch takes microseconds, so
    a call is bounded by the 5 s floor, not 60 s. Two workers; 300 requests, the sixth
    hangs: the 299 others are answered within a client timeout of 20 s each, and the hanging
    one is dead-lettered after its 3 deliveries (max_deliveries), 3 bounds and 3 restarts."""
    workers = [spawn_worker(spec("hang")) for _ in range(2)]
    inputs: list[object] = list(range(300))
    inputs[5] = "hang"
    with Producer(redis_url=redis_url, queue=queue) as producer:
        sent = [(producer.submit(x), time.monotonic()) for x in inputs]
        for x, (handle, at) in zip(inputs, sent, strict=True):
            if x != "hang":
                left = CLIENT_TIMEOUT_S - (time.monotonic() - at)
                result = producer.wait(handle, timeout_s=max(0.0, left))
                assert (result.status, result.output) == ("ok", x)
        poison, at = sent[5]
        result = producer.wait(poison, timeout_s=T)
        dead_after_s = time.monotonic() - at
        assert (result.status, result.error_type) == ("error", "MaxDeliveries")
    assert dead_after_s < 45, dead_after_s  # with max_batch_ms 60000: over 3 minutes
    logs = "".join(w.log() for w in workers)
    assert logs.count("max_batch_ms=auto: 5000 ms (slowest call timed") >= 2
    assert logs.count("past max_batch_ms=auto (5000 ms)") == 3
    assert logs.count("died (status 70); restarting") == 3
    assert all(w.proc.poll() is None for w in workers)
    assert_all_done(rclient, keys)


@pytest.mark.slow
def test_a_hung_call_hands_back_the_read_ahead_early_and_the_worker_reports_unhealthy(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = HangsOn()
    inputs: list[object] = list(range(100))
    inputs[3] = "hang"
    try:
        with Producer(redis_url=redis_url, queue=queue) as producer:
            handles = [producer.submit(x) for x in inputs]
            # All in the work streams before the worker reads: its first reads take them all
            # (admitted while it read, some would come after its model call hung, unread).
            admit_inbox(rclient, keys)
            thread = start_worker(model=model)  # default settings
            worker = thread.worker
            assert worker.stats()["max_batch_ms"] == 5000  # the floor: a warm-up of microseconds
            check = ["worker", "--check", "--redis-url", redis_url, "--queue", queue]
            check += ["--worker-id", worker.worker_id]
            assert model.entered.wait(T)
            entered = time.monotonic()
            wait_until(lambda: not thread.alive, "the hung worker to give up")
            judged_after_s = time.monotonic() - entered
            assert isinstance(thread.error, WorkerHung)
            thread.error = None  # seen here; the fixture must not raise it again
            assert 4.5 < judged_after_s < 15, judged_after_s  # its 5 s bound, not 60 s
            # Its hung call still runs in this process: unhealthy.
            done = run_cli(*check)
            assert done.returncode == 1, done.stdout
            assert "unhealthy" in done.stderr
            # Everything it read is pending, idle past claim_idle_ms (10 s): any worker's
            # reclaimer takes it at its next look. The hung batch keeps its delivery; what
            # it read ahead is as if never delivered.
            held = _held(rclient, keys)
            assert len(held) == 100
            assert all(e["time_since_delivered"] >= 10_000 for e in held)
            started = [e for e in held if e["times_delivered"] == 1]
            ahead = [e for e in held if e["times_delivered"] == 0]
            assert 1 <= len(started) <= 32
            assert len(started) + len(ahead) == 100
            # The read-ahead went back once the call ran a quarter of its bound, before the
            # verdict.
            lines = [r.getMessage() for r in caplog.records]
            early = next(i for i, m in enumerate(lines) if "running long" in m)
            hung = next(i for i, m in enumerate(lines) if "past max_batch_ms=auto" in m)
            assert early < hung
            assert f"handing back {len(ahead)} requests it read ahead" in lines[early]
            other = start_worker(batch_size=32)
            served_at = time.monotonic()
            assert [producer.result(h, timeout_s=T) for h in handles] == inputs
            assert time.monotonic() - served_at < CLIENT_TIMEOUT_S
            assert other.alive
    finally:
        model.release.set()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_a_hang_that_blocks_the_event_loop_is_handed_back_from_the_watchdogs_thread(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    model = HangsOn()
    port = _free_port()
    thread = start_worker(model=model, metrics_port=port)
    worker = thread.worker
    check = ["worker", "--check", "--redis-url", redis_url, "--queue", queue]
    check += ["--worker-id", worker.worker_id]
    try:
        with Producer(redis_url=redis_url, queue=queue) as producer:
            # Quick batches one after the other: the model then runs on the event loop (Pace).
            for i in range(40):
                assert producer.result(producer.submit(i), timeout_s=T) == i
            inputs = ["hang", *range(20)]
            handles = [producer.submit(x) for x in inputs]
            assert model.entered.wait(T)
            assert model.threads == [f"test-worker-{worker.worker_id}"]  # the loop's own
            wait_until(
                lambda: rclient.zscore(keys.workers, worker.worker_id) is None,
                "the watchdog to sign the worker off",
            )
            wait_until(
                lambda: all(e["time_since_delivered"] >= 30_000 for e in _held(rclient, keys)),
                "the watchdog to hand back what the worker holds",
            )
            held = _held(rclient, keys)
            assert held
            assert thread.alive  # its loop is still blocked
            done = run_cli(*check)
            assert done.returncode == 1, done.stdout
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                assert "batchline_healthy 0.0" in r.read().decode()
            model.release.set()
            wait_until(lambda: not thread.alive, "the worker to stop once its loop is free")
            assert isinstance(thread.error, WorkerHung)
            thread.error = None
            start_worker()
            assert [producer.result(h, timeout_s=T) for h in handles] == inputs
    finally:
        model.release.set()
    assert_all_done(rclient, keys)
