"""Statistics: a recorder the drivers feed, and the frozen snapshot it returns.

The recorder keeps counters and a bounded window of recent samples (the last
``window`` values of each timing), so memory stays flat however long a batcher lives;
percentiles in a snapshot describe that recent window.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

__all__ = ["BatchStats", "Percentiles", "StatsRecorder"]


@dataclass(frozen=True, slots=True)
class Percentiles:
    """Percentiles of a timing, in milliseconds, over the recorder's recent window."""

    p50: float = 0.0
    p95: float = 0.0
    p99: float = 0.0
    mean: float = 0.0
    samples: int = 0

    @classmethod
    def of(cls, samples_s: Iterable[float]) -> Percentiles:
        """Percentiles (in ms) of samples given in seconds."""
        data = np.fromiter(samples_s, dtype=np.float64)
        if data.size == 0:
            return cls()
        p50, p95, p99 = np.percentile(data, [50, 95, 99]) * 1e3
        return cls(float(p50), float(p95), float(p99), float(data.mean() * 1e3), int(data.size))


@dataclass(frozen=True, slots=True)
class BatchStats:
    """A frozen snapshot of one batcher's statistics.

    Attributes:
        items: items that ran in a batch.
        calls: caller invocations that finished.
        batches: batches formed and run.
        mean_batch_size: items per batch, on average.
        batch_size_histogram: batch size -> number of batches of that size.
        queue_size: items waiting right now.
        queue_wait_ms: time from arrival to the start of the item's batch.
        latency_ms: time from call to result, per call (end to end).
        function_ms: time of each call of the batch function.
        function_time_s: total time spent in the batch function.
        padding_efficiency: real / padded elements over all batches (inference variants);
            None when nothing was padded.
        errors: items that ended with an error (including timeouts and rejections).
        expired: items whose call's timeout or deadline passed before they had a result:
            dropped from the queue, or given up by their caller as it stopped waiting
            (whichever noticed first; a call cancelled otherwise is not counted).
        rejected: items refused at submission (queue full, too large, closed).
        batch_size: the batch size limit in force (in latency-SLO mode, the one chosen).
        timeout_ms: the wait for a batch to fill in force (likewise).
        target_p99_ms: the latency target of latency-SLO mode, or None.
    """

    items: int = 0
    calls: int = 0
    batches: int = 0
    mean_batch_size: float = 0.0
    batch_size_histogram: Mapping[int, int] = field(default_factory=dict)
    queue_size: int = 0
    queue_wait_ms: Percentiles = Percentiles()
    latency_ms: Percentiles = Percentiles()
    function_ms: Percentiles = Percentiles()
    function_time_s: float = 0.0
    padding_efficiency: float | None = None
    errors: int = 0
    expired: int = 0
    rejected: int = 0
    batch_size: int = 0
    timeout_ms: float = 0.0
    target_p99_ms: float | None = None


class StatsRecorder:
    """Collects statistics from a driver; thread-safe; :meth:`snapshot` freezes them."""

    def __init__(self, window: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._queue_wait: deque[float] = deque(maxlen=window)
        self._latency: deque[float] = deque(maxlen=window)
        self._call_log: deque[tuple[float, int]] = deque()
        self._function: deque[float] = deque(maxlen=window)
        self._histogram: dict[int, int] = {}
        self._items = 0
        self._calls = 0
        self._batches = 0
        self._function_total = 0.0
        self._real = 0
        self._padded = 0
        self._errors = 0
        self._expired = 0
        self._rejected = 0
        self._settings: tuple[int, float, float | None] = (0, 0.0, None)

    def record_batch(self, waits_s: list[float], function_s: list[float]) -> None:
        """One batch ran: each item's queue wait and each batch-function call's duration."""
        size = len(waits_s)
        with self._lock:
            self._batches += 1
            self._items += size
            self._histogram[size] = self._histogram.get(size, 0) + 1
            self._queue_wait.extend(waits_s)
            self._function.extend(function_s)
            self._function_total += sum(function_s)

    def record_settings(
        self, batch_size: int, timeout_ms: float, target_p99_ms: float | None = None
    ) -> None:
        """The batch size and wait in force from now on (and the latency target, if any)."""
        target = self._settings[2] if target_p99_ms is None else target_p99_ms
        self._settings = (batch_size, timeout_ms, target)  # one assignment: read whole

    def record_call(self, latency_s: float, *, ok: bool, items: int) -> None:
        """One caller's call finished, after ``latency_s``, successfully or not.

        On the hot path (once per call), so it takes no lock: ``deque.append`` is atomic, and
        the entries are folded into the counters in chunks, under the lock.
        """
        self._call_log.append((latency_s, 0 if ok else items))
        if len(self._call_log) >= 1024:
            with self._lock:
                self._fold_calls()

    def _fold_calls(self) -> None:
        log = self._call_log
        while log:
            latency_s, failed = log.popleft()
            self._calls += 1
            self._latency.append(latency_s)
            self._errors += failed

    def record_expired(self, items: int) -> None:
        """Items left the queue because their deadline passed."""
        with self._lock:
            self._expired += items

    def record_rejected(self, items: int) -> None:
        """Items were refused at submission."""
        with self._lock:
            self._rejected += items

    def record_padding(self, real: int, padded: int) -> None:
        """A padded batch held ``real`` elements of data in ``padded`` elements."""
        with self._lock:
            self._real += real
            self._padded += padded

    def snapshot(self, queue_size: int) -> BatchStats:
        """A frozen copy of the statistics now."""
        with self._lock:
            self._fold_calls()
            waits = list(self._queue_wait)
            latency = list(self._latency)
            function = list(self._function)
            histogram = dict(sorted(self._histogram.items()))
            counts = (self._items, self._calls, self._batches, self._errors)
            expired, rejected = self._expired, self._rejected
            function_total, real, padded = self._function_total, self._real, self._padded
        items, calls, batches, errors = counts
        return BatchStats(
            items=items,
            calls=calls,
            batches=batches,
            mean_batch_size=items / batches if batches else 0.0,
            batch_size_histogram=MappingProxyType(histogram),
            queue_size=queue_size,
            queue_wait_ms=Percentiles.of(waits),
            latency_ms=Percentiles.of(latency),
            function_ms=Percentiles.of(function),
            function_time_s=function_total,
            padding_efficiency=real / padded if padded else None,
            errors=errors,
            expired=expired,
            rejected=rejected,
            batch_size=self._settings[0],
            timeout_ms=self._settings[1],
            target_p99_ms=self._settings[2],
        )
