"""Statistics: the recorder and its frozen snapshot."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from batchline import BatchStats, Percentiles
from batchline.core.stats import StatsRecorder


def test_snapshot_is_frozen() -> None:
    snap = StatsRecorder().snapshot(queue_size=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.items = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.latency_ms.p50 = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        snap.batch_size_histogram[1] = 2  # type: ignore[index]


def test_snapshot_does_not_change_after_more_records() -> None:
    rec = StatsRecorder()
    rec.record_batch([0.001, 0.002], [0.01])
    before = rec.snapshot(queue_size=3)
    rec.record_batch([0.001] * 4, [0.01])
    assert before.items == 2
    assert before.batches == 1
    assert dict(before.batch_size_histogram) == {2: 1}
    assert before.queue_size == 3


def test_empty_snapshot() -> None:
    snap = StatsRecorder().snapshot(queue_size=0)
    assert snap == BatchStats(batch_size_histogram=snap.batch_size_histogram)
    assert snap.mean_batch_size == 0.0
    assert snap.padding_efficiency is None
    assert snap.latency_ms == Percentiles()


def test_percentiles_in_milliseconds() -> None:
    samples_s = [i / 1000 for i in range(1, 101)]  # 1 .. 100 ms
    p = Percentiles.of(samples_s)
    expected = np.percentile(np.arange(1, 101, dtype=float), [50, 95, 99])
    assert (p.p50, p.p95, p.p99) == pytest.approx(tuple(expected))
    assert p.mean == pytest.approx(50.5)
    assert p.samples == 100
    assert Percentiles.of([]) == Percentiles()


def test_counts_histogram_and_mean_batch_size() -> None:
    rec = StatsRecorder()
    for size in (4, 4, 2, 1):
        rec.record_batch([0.001] * size, [0.005])
    rec.record_call(0.01, ok=True, items=3)
    rec.record_call(0.02, ok=False, items=2)
    rec.record_expired(2)
    rec.record_rejected(5)
    snap = rec.snapshot(queue_size=7)
    assert snap.items == 11
    assert snap.batches == 4
    assert snap.mean_batch_size == pytest.approx(11 / 4)
    assert dict(snap.batch_size_histogram) == {1: 1, 2: 1, 4: 2}
    assert list(snap.batch_size_histogram) == [1, 2, 4], "sorted by batch size"
    assert snap.calls == 2
    assert snap.errors == 2
    assert snap.expired == 2
    assert snap.rejected == 5
    assert snap.queue_size == 7
    assert snap.function_time_s == pytest.approx(0.02)
    assert snap.function_ms.samples == 4
    assert snap.function_ms.p50 == pytest.approx(5.0)
    assert snap.queue_wait_ms.samples == 11
    assert snap.latency_ms.samples == 2


def test_padding_efficiency_is_real_over_padded() -> None:
    rec = StatsRecorder()
    rec.record_padding(6, 8)
    rec.record_padding(3, 8)
    assert rec.snapshot(queue_size=0).padding_efficiency == pytest.approx(9 / 16)


def test_window_bounds_the_samples_but_not_the_counters() -> None:
    rec = StatsRecorder(window=10)
    for _ in range(25):
        rec.record_batch([0.001], [0.001])
    snap = rec.snapshot(queue_size=0)
    assert snap.items == 25
    assert snap.queue_wait_ms.samples == 10
    assert snap.function_ms.samples == 10
    assert snap.function_time_s == pytest.approx(0.025)
