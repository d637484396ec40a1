"""Latency-SLO mode: pick batch size and wait online to keep p99 latency under a target.

A pure controller: no threads, no clock of its own, no I/O. A driver reports every batch it
ran (:meth:`SloController.observe`: when it started, each item's queue wait, how long the
batch function took) and applies the settings the controller answers with to its policy.

The model. A batch of ``b`` items takes about ``t(b) = a + c * b`` seconds: ``a`` and ``c``
are fitted by exponentially weighted least squares over the recent batches (a fixed cost per
call plus a cost per item, which is what a vectorised model looks like). An item that arrives
just after a batch started waits for that batch, then for its own batch to fill (at most the
wait ``timeout``) and run, so its latency is at most about ``timeout + 2 * t(b)``.

The choice. Throughput ``b / t(b)`` grows with ``b``, so the controller picks the largest
``b`` whose worst case fits the budget, ``2 * t(b) <= budget``, and spends what is left of
the budget on waiting for the batch to fill: ``timeout = budget - 2 * t(b)``. The budget is
the target times a margin that feedback adjusts: when the p99 of the latencies observed over
the recent window is above the target the margin shrinks, when it is well below the margin
grows back (bounded), so the worst-case bound, which real traffic rarely meets, does not waste
throughput. When the arrival rate exceeds what that batch size can serve, no setting meets the
target: the controller then gives up the target for throughput until the load falls, with no
wait and the smallest batch that serves the load and backlog with headroom (up to
``max_batch_size``, which it takes when none does).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["SloConfig", "SloController", "SloSettings"]


@dataclass(frozen=True, slots=True)
class SloConfig:
    """Settings of one controller.

    Attributes:
        target_p99_s: the latency target (queue wait plus batch function time), seconds.
        max_batch_size: the largest batch the controller may choose.
        max_timeout_s: the longest wait for a batch to fill it may choose.
        window: latencies kept for the observed p99 (the most recent ones).
        decay: weight of an old batch in the time fit, per newer batch (0 < decay < 1).
    """

    target_p99_s: float
    max_batch_size: int = 32
    max_timeout_s: float = 0.05
    window: int = 1000
    decay: float = 0.98

    def __post_init__(self) -> None:
        if not (self.target_p99_s > 0 and math.isfinite(self.target_p99_s)):
            raise ValueError(f"target_p99_ms must be a finite number > 0, got {self.target_p99_s}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0 < self.decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")


@dataclass(frozen=True, slots=True)
class SloSettings:
    """What the controller chose: the batch size, the wait, and why."""

    batch_size: int
    timeout_s: float
    overloaded: bool = False


_MARGIN_MIN = 0.5
_MARGIN_MAX = 1.5
_RATE_HALF_LIFE_S = 0.25
_HEADROOM = 1.25  # capacity kept above the arrival rate, for bursts


class SloController:
    """See the module docstring. Not thread-safe: the driver calls it from one place."""

    def __init__(self, config: SloConfig) -> None:
        self.config = config
        self.margin = 0.8
        # Weighted sums for the least-squares fit of t(b) = a + c*b.
        self._sw = self._sb = self._st = self._sbb = self._sbt = 0.0
        self._latencies: deque[float] = deque(maxlen=config.window)
        self._since_feedback = 0
        self._rate = 0.0  # items per second, exponentially smoothed
        self._last_start: float | None = None
        self._queued = 0
        self.settings = SloSettings(batch_size=1, timeout_s=0.0)

    # -- observations ---------------------------------------------------------------------------

    def observe(
        self, start: float, waits_s: list[float], function_s: float, *, queued: int = 0
    ) -> SloSettings:
        """One batch of ``len(waits_s)`` items started at ``start`` (the driver's clock) and
        its function ran ``function_s`` seconds, leaving ``queued`` items waiting when it
        started; returns the settings for the next batches."""
        size = len(waits_s)
        if size == 0:
            return self.settings
        self._fit(size, function_s)
        self._arrivals(start, size)
        self._queued = queued
        self._latencies.extend(w + function_s for w in waits_s)
        self._since_feedback += size
        if self._since_feedback >= max(50, self.config.window // 10):
            self._feedback()
        self.settings = self._choose()
        return self.settings

    def time_s(self, batch_size: int) -> float:
        """The fitted time of one batch of ``batch_size`` items."""
        a, c = self._coefficients()
        return max(0.0, a + c * batch_size)

    @property
    def observed_p99_s(self) -> float:
        """p99 of the recent latencies (queue wait + function time), 0 before any: numpy's
        default (linear) percentile, computed here because the first ``np.percentile`` call
        of a process costs 15-30 ms of imports, a stall on the batcher's path."""
        if not self._latencies:
            return 0.0
        ordered = sorted(self._latencies)
        k = (len(ordered) - 1) * 0.99
        low = math.floor(k)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (k - low)

    @property
    def rate_per_s(self) -> float:
        """The smoothed arrival rate, items per second."""
        return self._rate

    def _fit(self, size: int, seconds: float) -> None:
        d = self.config.decay
        self._sw = self._sw * d + 1.0
        self._sb = self._sb * d + size
        self._st = self._st * d + seconds
        self._sbb = self._sbb * d + size * size
        self._sbt = self._sbt * d + size * seconds

    def _coefficients(self) -> tuple[float, float]:
        if self._sw == 0:
            return 0.0, 0.0
        mean_b, mean_t = self._sb / self._sw, self._st / self._sw
        var_b = self._sbb / self._sw - mean_b * mean_b
        if var_b <= 1e-9 * max(1.0, mean_b * mean_b):
            # One batch size seen so far: assume time proportional to size (the cautious
            # reading: a larger batch is predicted no cheaper per item).
            return 0.0, mean_t / max(mean_b, 1.0)
        c = (self._sbt / self._sw - mean_b * mean_t) / var_b
        c = max(c, 0.0)
        a = max(mean_t - c * mean_b, 0.0)
        return a, c

    def _arrivals(self, start: float, size: int) -> None:
        # Items served per second between batch starts, smoothed over about a second: under
        # a steady load the served rate is the arrival rate; above capacity it is capacity,
        # which the overload test below compares against.
        last, self._last_start = self._last_start, start
        if last is None or start <= last:
            return
        gap = start - last
        weight = 1.0 - 0.5 ** (gap / _RATE_HALF_LIFE_S)
        self._rate += weight * (size / gap - self._rate)

    def _feedback(self) -> None:
        self._since_feedback = 0
        p99, target = self.observed_p99_s, self.config.target_p99_s
        if p99 > target:
            self.margin = max(_MARGIN_MIN, self.margin * max(0.7, target / p99))
        elif p99 < 0.8 * target:
            self.margin = min(_MARGIN_MAX, self.margin * 1.05)

    # -- the choice -----------------------------------------------------------------------------

    def _choose(self) -> SloSettings:
        cfg = self.config
        budget = cfg.target_p99_s * self.margin
        # The largest batch whose worst case (wait for the running batch, then run) fits.
        fits = 1
        while fits < cfg.max_batch_size and 2 * self.time_s(fits + 1) <= budget:
            fits += 1
        # The smallest batch that serves the load with headroom: a limit below it would let
        # the queue grow without bound, which breaks any target.
        # A backlog must drain within the budget too: it counts as load.
        load = _HEADROOM * self._rate + self._queued / budget
        need = 1
        while need < cfg.max_batch_size and self._capacity(need) < load:
            need += 1
        if need > fits:
            # No setting meets the target at this load: keep up with it, without a wait.
            return SloSettings(max(need, fits), 0.0, overloaded=True)
        timeout = min(cfg.max_timeout_s, max(0.0, budget - 2 * self.time_s(fits)))
        return SloSettings(fits, timeout)

    def _capacity(self, batch_size: int) -> float:
        t = self.time_s(batch_size)
        return batch_size / t if t > 0 else math.inf
