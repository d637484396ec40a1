"""When a worker reads while the fair share holds requests (batchline/worker/serving/
_dispatch.py): one batch while its model is free, none while a batch runs until its last
moments, and how many entries the admission dispatches on its own. Times are given, not
waited for."""

from __future__ import annotations

import time

from batchline.config import WorkerSettings
from batchline.worker.serving._dispatch import Dispatcher


def dispatcher(*, batch_size: int = 8, generation: bool = False) -> Dispatcher:
    made = Dispatcher(WorkerSettings(queue="q", batch_size=batch_size), generation=generation)
    made.held = 100
    return made


def test_with_requests_held_a_free_model_reads_one_batch() -> None:
    d = dispatcher()
    assert d.window(128, since=lambda: None) == (8, 0.0)


def test_before_any_call_ran_a_busy_model_reads_nothing() -> None:
    d = dispatcher()
    assert d.window(128, since=time.time) == (0, 0.0)


def test_a_busy_model_reads_its_next_batch_only_as_the_batch_under_way_ends() -> None:
    d = dispatcher()
    d.ran(time.time() - 0.100)  # calls run about 100 ms
    now = time.time()
    window, opens_s = d.window(128, since=lambda: now - 0.030)
    assert window == 0
    assert 0.050 < opens_s <= 0.075  # at its expected end (less twice a read's time: ~0)
    assert d.window(128, since=lambda: now - 0.100) == (8, 0.0)


def test_nothing_held_reads_as_the_worker_would_without_tenants() -> None:
    d = dispatcher()
    d.held = 0
    assert d.window(128, since=time.time) == (128, 0.0)


def test_generation_keeps_its_own_window() -> None:
    d = dispatcher(generation=True)
    assert d.window(16, since=time.time) == (16, 0.0)


def test_the_admission_dispatches_an_entry_per_live_worker_at_most_a_batch() -> None:
    d = dispatcher(batch_size=4)
    assert d.admit_ahead == 1  # before the first heartbeat: itself
    d.live(3)
    assert d.admit_ahead == 3
    d.live(10)
    assert d.admit_ahead == 4
    d.live(0)
    assert d.admit_ahead == 1
