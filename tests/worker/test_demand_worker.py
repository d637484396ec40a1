"""Workers whose model may be unloaded when idle (``unload_idle_s``) or loads by demand
(``load demand``), in this process against a real Redis: what they do at start and when a
load fails. The lazy model on its own: test_lazy_model.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.support.service import WorkerThread, spec


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
