"""The latency-SLO controller, driven with the real policy on a simulated clock.

A discrete-event simulation: Poisson arrivals, a batch function that takes 2 ms + 0.4 ms per
item, one batch at a time, the policy polled whenever the function is free. No threads and no
real time, so every figure is exact and repeatable.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import pytest

from batchline.core.policy import BatchPolicy, PolicyConfig
from batchline.core.slo import SloConfig, SloController


def model_s(b: int) -> float:
    return 0.002 + 0.0004 * b


@dataclass
class Item:
    arrival: float
    deadline: float | None = None
    length: int = 1
    priority: int = 0
    small: bool = False
    queued: bool = False

    @property
    def cancelled(self) -> bool:
        return False


@dataclass
class Outcome:
    p99_ms: float
    served_per_s: float
    batch_sizes: list[int]
    controller: SloController | None
    worst_ms: list[tuple[float, float]]  # per batch: when it started, its worst latency


def simulate(
    rate_per_s: float,
    *,
    target_ms: float | None = None,
    batch_size: int = 64,
    timeout_ms: float = 10.0,
    seconds: float = 20.0,
    seed: int = 1,
    stalls: tuple[tuple[float, float], ...] = (),
) -> Outcome:
    """``stalls``: (when, how long) the whole process pauses, as a busy machine pauses it:
    nothing runs, arrivals keep coming; one that falls while the function runs makes it
    take that much longer (the controller sees it in the function's time, as a driver does)."""
    rng = random.Random(seed)
    config = PolicyConfig(batch_size=batch_size, timeout_s=timeout_ms / 1e3)
    policy: BatchPolicy[Item] = BatchPolicy(config)
    slo = (
        None
        if target_ms is None
        else SloController(
            SloConfig(
                target_p99_s=target_ms / 1e3,
                max_batch_size=batch_size,
                max_timeout_s=timeout_ms / 1e3,
            )
        )
    )
    arrivals: list[float] = []
    t = 0.0
    while t < seconds:
        t += rng.expovariate(rate_per_s)
        arrivals.append(t)
    now, i, done_items = 0.0, 0, 0
    latencies: list[float] = []
    sizes: list[int] = []
    worst: list[tuple[float, float]] = []
    warm = seconds / 4
    pending_stalls = sorted(stalls)
    while i < len(arrivals) or len(policy):
        if pending_stalls and now >= pending_stalls[0][0]:
            now += pending_stalls.pop(0)[1]
        while i < len(arrivals) and arrivals[i] <= now:
            policy.add(Item(arrivals[i]))
            i += 1
        decision = policy.poll(now)
        if decision.batch:
            took = model_s(len(decision.batch))
            if pending_stalls and now + took >= pending_stalls[0][0]:
                took += pending_stalls.pop(0)[1]
            waits = [now - it.arrival for it in decision.batch]
            worst.append((now, (max(waits) + took) * 1e3))
            if now >= warm:
                latencies += [w + took for w in waits]
                sizes.append(len(decision.batch))
                done_items += len(decision.batch)
            if slo is not None:
                chosen = slo.observe(now, waits, took, queued=len(policy))
                policy.config = PolicyConfig(
                    batch_size=chosen.batch_size, timeout_s=chosen.timeout_s
                )
            now += took
            continue
        upcoming = arrivals[i] if i < len(arrivals) else math.inf
        wake = decision.wake_at if decision.wake_at is not None else math.inf
        now = max(now, min(upcoming, wake))
        if now == math.inf:
            break
    span = now - warm
    return Outcome(
        p99_ms=float(np.percentile(latencies, 99)) * 1e3,
        served_per_s=done_items / span,
        batch_sizes=sizes,
        controller=slo,
        worst_ms=worst,
    )


def best_fixed(rate_per_s: float, target_ms: float) -> float:
    """The most a fixed setting serves within the target at this load (a sweep)."""
    best = 0.0
    for b in (1, 2, 4, 8, 16, 24, 32, 48, 64):
        for timeout_ms in (0.0, 1.0, 2.0, 5.0, 10.0):
            out = simulate(rate_per_s, batch_size=b, timeout_ms=timeout_ms, seconds=8.0)
            if out.p99_ms <= target_ms:
                best = max(best, out.served_per_s)
    return best


def random_stalls(mean_s: float, every_s: float, until_s: float) -> tuple[tuple[float, float], ...]:
    """Pauses at Poisson times, ``every_s`` apart on average, of exponential length."""
    rng = random.Random(5)
    stalls: list[tuple[float, float]] = []
    t = 1.0
    while t < until_s:
        t += rng.expovariate(1 / every_s)
        stalls.append((t, rng.expovariate(1 / mean_s)))
    return tuple(stalls)


def best_fixed_under(
    rate_per_s: float, stalls: tuple[tuple[float, float], ...], seconds: float
) -> tuple[float, int]:
    """The lowest p99 (ms) of the fixed settings that keep up (no wait), under the same
    stalls, and the smallest batch size within 5 % of it."""
    p99 = {
        b: simulate(rate_per_s, batch_size=b, timeout_ms=0.0, seconds=seconds, stalls=stalls).p99_ms
        for b in (8, 16, 32, 64)
    }
    best = min(p99.values())
    return best, min(b for b, ms in p99.items() if ms <= 1.05 * best)


def test_a_stall_is_recovered_from() -> None:
    # A 30 ms pause at 800/s leaves 24 items queued and breaks the target for them; the
    # controller shrinks its margin (its observed p99 is above the target). The backlog is
    # still served at once (a backlog counts as load: the limit is lifted), latencies are
    # back under the target within a few batches, and the margin and the batch limit grow
    # back once the pause has left the window.
    stall_at, target = 3.0, 20.0
    out = simulate(
        800.0, target_ms=target, timeout_ms=20.0, seconds=8.0, stalls=((stall_at, 0.03),)
    )
    slo = out.controller
    assert slo is not None
    after = [(start, ms) for start, ms in out.worst_ms if start >= stall_at]
    over = [i for i, (_, ms) in enumerate(after) if ms > target]
    assert over, "the pause must break the target for the items it held"
    assert max(over) < 5, after[: max(over) + 1]
    best_p99, best_size = best_fixed_under(800.0, ((stall_at, 0.03),), 8.0)
    assert out.p99_ms <= 1.05 * best_p99
    assert slo.margin >= SloController(slo.config).margin  # past where it started
    assert slo.settings.batch_size >= best_size


@pytest.mark.parametrize(
    ("rate", "mean_ms", "every_s"),
    [(800.0, 3.0, 0.1), (800.0, 10.0, 0.5), (1400.0, 2.0, 0.1), (1400.0, 8.0, 0.5)],
)
def test_under_repeated_stalls_the_p99_is_near_the_best_fixed_settings(
    rate: float, mean_ms: float, every_s: float
) -> None:
    # Stalls shrink the margin, so the controller runs with smaller batch limits than it
    # would on a quiet machine; that costs little: under the very same stalls its p99 is
    # within 10 % of the best fixed setting's (which it meets wherever that one meets it).
    seconds, target = 10.0, 20.0
    stalls = random_stalls(mean_ms / 1e3, every_s, seconds)
    out = simulate(rate, target_ms=target, timeout_ms=20.0, seconds=seconds, stalls=stalls)
    best_p99, _ = best_fixed_under(rate, stalls, seconds)
    assert out.p99_ms <= 1.1 * best_p99, (out.p99_ms, best_p99)
    if best_p99 <= target:
        assert out.p99_ms <= target
    assert out.served_per_s == pytest.approx(rate, rel=0.05)


@pytest.mark.parametrize("rate", [200.0, 800.0, 1500.0])
def test_p99_stays_under_the_target_below_capacity(rate: float) -> None:
    out = simulate(rate, target_ms=30.0)
    assert out.p99_ms <= 30.0, out.p99_ms
    assert out.served_per_s == pytest.approx(rate, rel=0.1)


def test_fixed_settings_break_the_target_or_lose_throughput_the_controller_does_neither() -> None:
    # A fixed wait of 20 ms breaks a 20 ms target at a light load...
    assert simulate(200.0, batch_size=64, timeout_ms=20.0).p99_ms > 20.0
    assert simulate(200.0, target_ms=20.0, batch_size=64, timeout_ms=20.0).p99_ms <= 20.0
    # ... and a fixed small batch cannot serve a heavy one (8 items per 5.2 ms: 1,538/s).
    # (A 20 ms target is out of reach at 1,700/s for any setting: 25 ms here.)
    small = simulate(1700.0, batch_size=8, timeout_ms=0.0, seconds=8.0)
    assert small.served_per_s < 1600.0
    tuned = simulate(1700.0, target_ms=25.0, seconds=8.0)
    assert tuned.served_per_s == pytest.approx(1700.0, rel=0.05)
    assert tuned.p99_ms <= 25.0


@pytest.mark.slow
def test_throughput_at_the_target_is_near_the_best_fixed_setting() -> None:
    rate = 1500.0
    tuned = simulate(rate, target_ms=20.0, seconds=8.0)
    assert tuned.p99_ms <= 20.0
    assert tuned.served_per_s >= 0.9 * best_fixed(rate, 20.0)


def test_overload_serves_the_most_it_can() -> None:
    # 64 items per 27.6 ms is about 2,300/s: more than that cannot be served at all.
    out = simulate(3000.0, target_ms=30.0, seconds=6.0)
    assert out.controller is not None
    assert out.controller.settings.overloaded
    assert max(out.batch_sizes) == 64
    assert out.served_per_s >= 0.95 * 64 / model_s(64)


def test_the_fit_recovers_the_model_and_the_rate() -> None:
    out = simulate(1000.0, target_ms=30.0, seconds=10.0)
    slo = out.controller
    assert slo is not None
    assert slo.time_s(32) == pytest.approx(model_s(32), rel=0.05)
    assert slo.time_s(4) == pytest.approx(model_s(4), rel=0.1)
    assert slo.rate_per_s == pytest.approx(1000.0, rel=0.15)


def test_the_observed_p99_is_numpys_percentile() -> None:
    rng = np.random.default_rng(7)
    for n in (1, 2, 99, 100, 101, 1000, 1500):
        slo = SloController(SloConfig(target_p99_s=0.02))
        latencies = rng.exponential(0.005, n)
        for i, latency in enumerate(latencies):
            slo.observe(i * 0.01, [float(latency)], 0.0)
        kept = latencies[-slo.config.window :]
        assert slo.observed_p99_s == pytest.approx(float(np.percentile(kept, 99)), rel=1e-12)


def test_invalid_targets_are_refused() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="target_p99_ms"):
            SloConfig(target_p99_s=bad)
