"""Workers whose model may be unloaded when idle (``unload_idle_s``) or loads by demand
(``load demand``), in this process against a real Redis: what they do at start and when a
load fails. The lazy model on its own: test_lazy_model.py."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from batchline.keys import GROUP, QueueKeys
from batchline.producer import Producer

from tests.support.service import RESULT_TIMEOUT_S as T
from tests.support.service import WorkerThread, admit_inbox, run_cli, spec, wait_until


@pytest.mark.parametrize(
    ("settings", "bound_ms"),
    [
        ({}, 5000),
        ({"unload_idle_s": 600}, 5000),  # loaded at start: warmed up as any model
        ({"load": "demand"}, 60000),  # nothing loaded at start, nothing timed yet
    ],
    ids=["start", "unload_idle_s", "demand"],
)
def test_a_model_loaded_at_start_times_its_warm_up_batch_even_if_it_may_unload(
    start_worker: Callable[..., WorkerThread], settings: dict[str, Any], bound_ms: int
) -> None:
    """``hang`` has an ``example``: its warm-up batch takes microseconds, so max_batch_ms
    auto starts at the 5 s floor, not at the 60 s of a model with nothing timed."""
    worker = start_worker(model=spec("hang"), **settings).worker
    assert worker.stats()["max_batch_ms"] == bound_ms


def _held(client: redis.Redis, keys: QueueKeys) -> list[dict[str, Any]]:
    """The entries pending in the queue's group, every priority."""
    return [e for p in keys.streams for e in client.xpending_range(p, GROUP, "-", "+", 100)]


def test_a_load_by_demand_that_fails_hands_back_its_requests_until_a_load_succeeds(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A model loaded by demand whose load fails (here, until its weights' file is there;
    a misspelt module fails the same way): the requests that needed it are not answered
    with the load's error but handed back as they were, the error is logged, and the worker
    reports unhealthy, reading nothing; once a load succeeds it serves them."""
    weights = tmp_path / "weights"
    monkeypatch.setenv("BLTEST_LOAD_GATE", str(weights))
    with Producer(redis_url=redis_url, queue=queue) as producer:
        handles = [producer.submit(x) for x in ("a", "b", "c")]
        admit_inbox(rclient, keys)  # in the work stream before the worker: one read
        worker = start_worker(
            "tests.support.gated_model:fails_until_gate", load="demand", claim_idle_ms=60_000
        ).worker
        check = ["worker", "--check", "--redis-url", redis_url, "--queue", queue]
        check += ["--worker-id", worker.worker_id]
        wait_until(
            lambda: (
                len(held := _held(rclient, keys)) == 3
                and all(e["time_since_delivered"] >= 60_000 for e in held)
            ),
            "the requests to be handed back",
        )
        # As they were: never delivered, nothing answered (no error for the load's failure).
        assert [e["times_delivered"] for e in _held(rclient, keys)] == [0, 0, 0]
        assert not any(rclient.exists(keys.result(h.id)) for h in handles)
        assert worker.counts["error"] == 0
        wait_until(  # (a beat under way as it failed may land once more)
            lambda: rclient.zscore(keys.workers, worker.worker_id) is None,
            "the worker to leave the workers' set",
        )
        done = run_cli(*check)
        assert done.returncode == 1, done.stdout
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any("did not load: FileNotFoundError: no weights at" in m for m in errors)
        weights.touch()  # the weights are there: the next try loads
        wait_until(
            lambda: rclient.zscore(keys.workers, worker.worker_id) is not None,
            "the worker to load its model and report healthy again",
        )
        assert [producer.result(h, timeout_s=T) for h in handles] == ["a", "b", "c"]
    assert run_cli(*check).returncode == 0
