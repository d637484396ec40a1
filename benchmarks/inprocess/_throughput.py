"""Throughput of the in-process benchmark: items/s and mean batch size of each implementation.

``THREADS`` threads call the thread APIs and ``TASKS`` asyncio tasks the aio APIs, a fixed number
of items per cell (``COUNTS``); each repeat runs every cell of ``THROUGHPUT_ROWS`` once, so the
repeats are interleaved across implementations. The ideal is the model-like function called
back to back on full batches, no batcher, in the same repeat.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fast_dynamic_batcher.dyn_batcher import DynBatcher

from benchmarks.harness import log
from benchmarks.inprocess._batchers import (
    BATCH_SIZE,
    FDB_MODELS,
    FUNCTIONS,
    TASKS,
    THREADS,
    CellResult,
    Results,
    aio_batcher,
    anoop,
    closing_all,
    fmt_rate,
    mean_batch,
    model,
    stop_fdb,
    thread_batcher,
)

# -- item counts per cell --------------------------------------------------------------------------

# Items per throughput cell, sized for ~1-3 s per cell on a 2-core machine. --quick divides by
# QUICK_DIVISOR (and rounds up to whole rounds of callers).
COUNTS: dict[tuple[str, str, str], int] = {
    # (api, function, implementation): items
    ("thread", "noop", "batchline"): 80_000,
    ("thread", "noop", "batched"): 24_000,
    ("thread", "noop", "none"): 3_840_000,
    ("thread", "model", "batchline"): 16_000,
    ("thread", "model", "batched"): 16_000,
    ("thread", "model", "none"): 48_000,
    ("thread", "model", "none-serial"): 1_024,
    ("aio", "noop", "batchline"): 160_000,
    ("aio", "noop", "batched"): 80_000,
    ("aio", "noop", "fdb"): 2_000,
    ("aio", "noop", "none"): 3_000_000,
    ("aio", "anoop", "batchline"): 250_000,
    ("aio", "anoop", "batched"): 140_000,
    ("aio", "model", "batchline"): 16_000,
    ("aio", "model", "batched"): 16_000,
    ("aio", "model", "fdb"): 2_000,
    ("aio", "model", "none"): 5_000,
}
IDEAL_BATCHES = 500
QUICK_DIVISOR = 40


THROUGHPUT_ROWS: list[tuple[str, str, str, list[str]]] = [
    # (api, function key, row label, implementations)
    ("thread", "noop", "no-op", ["batchline", "batched", "none"]),
    ("thread", "model", "model-like", ["batchline", "batched", "none", "none-serial"]),
    ("aio", "noop", "no-op (sync fn)", ["batchline", "batched", "fdb", "none"]),
    ("aio", "anoop", "no-op (async fn)", ["batchline", "batched"]),
    ("aio", "model", "model-like", ["batchline", "batched", "fdb", "none"]),
]


def rounded_up(n: int, unit: int) -> int:
    return max(unit, -(-n // unit) * unit)


# -- harnesses -------------------------------------------------------------------------------------


def drive_threads(
    call: Callable[[int], Any], n_items: int, check: Callable[[int, Any], bool]
) -> tuple[float, int]:
    """``THREADS`` threads each call ``call(i)`` sequentially; items/s and wrong results."""
    per = n_items // THREADS
    barrier = threading.Barrier(THREADS + 1)
    errors = [0] * THREADS

    def worker(tid: int) -> None:
        barrier.wait()
        bad = 0
        base = tid * per
        try:
            for i in range(base, base + per):
                if not check(i, call(i)):
                    bad += 1
        except BaseException as exc:
            bad += per
            log(f"  worker {tid} failed: {exc!r}")
        errors[tid] = bad

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(THREADS)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    return per * THREADS / elapsed, sum(errors)


async def drive_tasks(
    acall: Callable[[int], Awaitable[Any]] | Callable[[int], Any],
    n_items: int,
    check: Callable[[int, Any], bool],
    *,
    awaited: bool = True,
) -> tuple[float, int]:
    """``TASKS`` tasks each await ``acall(i)`` sequentially; items/s and wrong results."""
    per = n_items // TASKS
    start = asyncio.Event()
    errors = [0] * TASKS

    async def worker(tid: int) -> None:
        await start.wait()
        bad = 0
        base = tid * per
        try:
            for i in range(base, base + per):
                r = (await acall(i)) if awaited else acall(i)
                if not check(i, r):
                    bad += 1
        except BaseException as exc:
            bad += per
            log(f"  task {tid} failed: {exc!r}")
        errors[tid] = bad

    tasks = [asyncio.create_task(worker(t)) for t in range(TASKS)]
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    start.set()
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    return per * TASKS / elapsed, sum(errors)


def same(i: int, r: Any) -> bool:
    return bool(r == i)


def same_list(i: int, r: Any) -> bool:
    return bool(r == [i])


# -- throughput cells ---------------------------------------------------------------------------------


def thread_cell(impl: str, fname: str, n: int) -> CellResult:
    fn = FUNCTIONS[fname]
    if impl in ("batchline", "batched"):
        f, close = thread_batcher(impl, fn, 5.0)
        with closing_all([close]):
            f(-1)  # starts the worker
            rate, bad = drive_threads(f, n, same)
            batch = mean_batch(impl, f)  # includes the one warm-up batch of 1
        return CellResult(rate, batch, bad)
    if impl == "none":
        rate, bad = drive_threads(lambda i: fn([i]), n, same_list)
        return CellResult(rate, None, bad)
    if impl == "none-serial":
        lock = threading.Lock()

        def serial(i: int) -> Any:
            with lock:
                return fn([i])

        rate, bad = drive_threads(serial, n, same_list)
        return CellResult(rate, None, bad)
    raise ValueError(impl)


async def aio_cell(impl: str, fname: str, n: int) -> CellResult:
    fn: Callable[..., Any] = anoop if fname == "anoop" else FUNCTIONS[fname]
    if impl in ("batchline", "batched"):
        f, aclose = aio_batcher(impl, fn, 5.0)
        try:
            await f(-1)
            rate, bad = await drive_tasks(f, n, same)
            batch = mean_batch(impl, f)
        finally:
            await aclose()
        return CellResult(rate, batch, bad)
    if impl == "fdb":
        dyn = DynBatcher(FDB_MODELS[fname], max_batch_size=BATCH_SIZE, max_delay=0.005)
        try:
            await dyn.process_batched(-1)  # waits for the spawned process to come up
            inv_sizes: list[float] = []

            async def call(i: int) -> Any:
                x, size = await dyn.process_batched(i)
                inv_sizes.append(1.0 / size)
                return x

            rate, bad = await drive_tasks(call, n, same)
            batch = len(inv_sizes) / sum(inv_sizes) if inv_sizes else None
        finally:
            await asyncio.to_thread(stop_fdb, dyn)
        return CellResult(rate, batch, bad)
    if impl == "none":
        if fname == "model":
            rate, bad = await drive_tasks(lambda i: asyncio.to_thread(fn, [i]), n, same_list)
        else:
            rate, bad = await drive_tasks(lambda i: fn([i]), n, same_list, awaited=False)
        return CellResult(rate, None, bad)
    raise ValueError(impl)


def ideal_rate(n_batches: int) -> float:
    batch = list(range(BATCH_SIZE))
    model(batch)
    t0 = time.perf_counter()
    for _ in range(n_batches):
        model(batch)
    return n_batches * BATCH_SIZE / (time.perf_counter() - t0)


def run_throughput(res: Results, repeats: int, scale: int) -> None:
    for r in range(repeats):
        log(f"throughput, repeat {r + 1}/{repeats}")
        res.add("ideal", ideal_rate(max(10, IDEAL_BATCHES // scale)))
        log(f"  ideal model-like: {fmt_rate(res.rows['ideal'][-1])} items/s")
        for api, fname, _label, impls in THROUGHPUT_ROWS:
            for impl in impls:
                key = (api, fname, impl)
                unit = THREADS if api == "thread" else TASKS
                n = rounded_up(COUNTS[key] // scale, unit)
                gc.collect()
                if api == "thread":
                    cell = thread_cell(impl, fname, n)
                else:
                    cell = asyncio.run(aio_cell(impl, fname, n))
                res.add_cell(key, cell)
                batch = "" if cell.batch is None else f", mean batch {cell.batch:.1f}"
                err = f", {cell.errors} WRONG RESULTS" if cell.errors else ""
                log(
                    f"  {api:6} {fname:5} {impl:11} {n:>9} items: {fmt_rate(cell.rate)}/s{batch}{err}"
                )
