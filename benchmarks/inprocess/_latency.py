"""Latency and idle CPU of the in-process benchmark, on an idle batcher and the no-op function.

Latency: one caller, sequential calls, at timeout_ms 5 and 0, as the time added over the
no-op's own. Idle CPU: one call, then the process's CPU time while idle, in % of one core.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
from fast_dynamic_batcher.dyn_batcher import DynBatcher

from benchmarks.harness import log
from benchmarks.inprocess._batchers import (
    BATCH_SIZE,
    NoopModel,
    Results,
    aio_batcher,
    anoop,
    closing_all,
    noop,
    stop_fdb,
    thread_batcher,
)


def percentiles_ms(samples: list[float]) -> tuple[float, float]:
    p50, p99 = np.percentile(np.asarray(samples), [50, 99]) * 1e3
    return float(p50), float(p99)


def own_time_s() -> float:
    """The no-op function's own time per call (median), to subtract from latencies."""
    samples = []
    for i in range(2000):
        t0 = time.perf_counter()
        noop([i])
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def latency_thread(impl: str, timeout_ms: float, calls: int) -> list[float]:
    f, close = thread_batcher(impl, noop, timeout_ms)
    samples = []
    with closing_all([close]):
        for i in range(10):
            f(i)
        for i in range(calls):
            t0 = time.perf_counter()
            f(i)
            samples.append(time.perf_counter() - t0)
    return samples


async def latency_aio(impl: str, fname: str, timeout_ms: float, calls: int) -> list[float]:
    fn: Callable[..., Any] = anoop if fname == "anoop" else noop
    samples: list[float] = []
    if impl == "fdb":
        dyn = DynBatcher(NoopModel, max_batch_size=BATCH_SIZE, max_delay=timeout_ms / 1e3)
        try:
            for i in range(10):
                await dyn.process_batched(i)
            for i in range(calls):
                t0 = time.perf_counter()
                await dyn.process_batched(i)
                samples.append(time.perf_counter() - t0)
        finally:
            await asyncio.to_thread(stop_fdb, dyn)
        return samples
    f, aclose = aio_batcher(impl, fn, timeout_ms)
    try:
        for i in range(10):
            await f(i)
        for i in range(calls):
            t0 = time.perf_counter()
            await f(i)
            samples.append(time.perf_counter() - t0)
    finally:
        await aclose()
    return samples


def cpu_pct_over(seconds: float, idle: Callable[[float], Any]) -> float:
    c0, w0 = time.process_time(), time.perf_counter()
    idle(seconds)
    c1, w1 = time.process_time(), time.perf_counter()
    return (c1 - c0) / (w1 - w0) * 100


def idle_cpu_thread(impl: str, timeout_ms: float | None, seconds: float) -> float:
    if impl == "baseline":
        return cpu_pct_over(seconds, time.sleep)
    if timeout_ms is None:
        raise ValueError(f"{impl}: timeout_ms is None (only the baseline runs without one)")
    f, close = thread_batcher(impl, noop, timeout_ms)
    with closing_all([close]):
        f(0)
        time.sleep(0.05)
        return cpu_pct_over(seconds, time.sleep)


async def idle_cpu_aio(impl: str, timeout_ms: float | None, seconds: float) -> float:
    async def idle() -> float:
        c0, w0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(seconds)
        c1, w1 = time.process_time(), time.perf_counter()
        return (c1 - c0) / (w1 - w0) * 100

    if impl == "baseline":
        return await idle()
    if timeout_ms is None:
        raise ValueError(f"{impl}: timeout_ms is None (only the baseline runs without one)")
    f, aclose = aio_batcher(impl, noop, timeout_ms)
    try:
        await f(0)
        await asyncio.sleep(0.05)
        return await idle()
    finally:
        await aclose()


def run_aio(fn: Callable[..., Coroutine[Any, Any, list[float]]], *args: Any) -> list[float]:
    return asyncio.run(fn(*args))


def run_latency(res: Results, calls: int, repeats: int) -> None:
    """Every cell ``repeats`` times, the cells of a repeat in an order rotated from the last
    one's; each cell's p50 and p99 the medians of its repeats'."""
    log("latency (single caller, idle batcher)")
    res.own_time_us = own_time_s() * 1e6
    own = res.own_time_us / 1e6
    configs: list[tuple[tuple[str, str, float], Callable[[], list[float]]]] = []
    for timeout_ms in (5.0, 0.0):
        configs += [
            (
                (impl, "thread", timeout_ms),
                functools.partial(latency_thread, impl, timeout_ms, calls),
            )
            for impl in ("batchline", "batched")
        ]
        configs += [
            (
                (impl, api, timeout_ms),
                functools.partial(run_aio, latency_aio, impl, fname, timeout_ms, calls),
            )
            for impl, api, fname in (
                ("batchline", "aio (sync fn)", "noop"),
                ("batchline", "aio (async fn)", "anoop"),
                ("batched", "aio (sync fn)", "noop"),
                ("batched", "aio (async fn)", "anoop"),
                ("fdb", "aio", "noop"),
            )
        ]
    runs: dict[tuple[str, str, float], list[tuple[float, float]]] = {k: [] for k, _ in configs}
    for rep in range(repeats):
        shift = rep * len(configs) // repeats
        for key, measure in configs[shift:] + configs[:shift]:
            runs[key].append(percentiles_ms([s - own for s in measure()]))
            (impl, api, timeout_ms), (p50, p99) = key, runs[key][-1]
            log(
                f"  {impl:9} {api:15} timeout_ms={timeout_ms:g}: p50 {p50:.3f} ms, p99 {p99:.3f} ms"
            )
    for key, _ in configs:  # in the configs' order: the report's
        res.latency[key] = (
            statistics.median(p50 for p50, _ in runs[key]),
            statistics.median(p99 for _, p99 in runs[key]),
        )


def run_idle_cpu(res: Results, seconds: float, repeats: int) -> None:
    """Every cell ``repeats`` times, interleaved as the latencies are; medians."""
    log(f"idle CPU ({seconds:g} s each)")
    cells: list[tuple[tuple[str, str, float | None], Callable[[], float]]] = [
        (("baseline", "thread", None), lambda: idle_cpu_thread("baseline", None, seconds)),
        (("baseline", "aio", None), lambda: asyncio.run(idle_cpu_aio("baseline", None, seconds))),
    ]
    for timeout_ms in (5.0, 0.0):
        for impl in ("batchline", "batched"):
            cells += [
                (
                    (impl, "thread", timeout_ms),
                    functools.partial(idle_cpu_thread, impl, timeout_ms, seconds),
                ),
                (
                    (impl, "aio", timeout_ms),
                    functools.partial(run_idle_aio, impl, timeout_ms, seconds),
                ),
            ]
    runs: dict[tuple[str, str, float | None], list[float]] = {k: [] for k, _ in cells}
    for rep in range(repeats):
        shift = rep * len(cells) // repeats
        for key, measure in cells[shift:] + cells[:shift]:
            gc.collect()
            runs[key].append(measure())
    for key, _ in cells:
        res.idle_cpu[key] = statistics.median(runs[key])
        (impl, api, t), pcts = key, runs[key]
        log(f"  {impl:9} {api:6} timeout_ms={t}: {', '.join(f'{p:.2f}' for p in pcts)} %")


def run_idle_aio(impl: str, timeout_ms: float, seconds: float) -> float:
    return asyncio.run(idle_cpu_aio(impl, timeout_ms, seconds))
