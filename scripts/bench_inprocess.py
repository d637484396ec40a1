"""In-process benchmark: batchline vs batched 0.1.5 vs fast-dynamic-batcher 1.1.0 vs none.

Everything runs in ONE process invocation on one machine, so the figures are comparable with
each other (and only with each other). What is measured:

1. throughput (items/s): 64 threads calling the thread APIs, 1000 asyncio tasks calling the
   aio APIs; a fixed number of items per cell, each cell repeated ``--repeats`` times (the
   repeats are interleaved across implementations) and the median reported;
2. mean batch size of each batcher (its own stats; counted in the function for
   fast-dynamic-batcher, whose function runs in another process);
3. share of the ideal throughput of the model-like function, the ideal being measured in the
   same run: the function called back to back on full batches of 32, no batcher;
4. single-caller latency (one caller, sequential calls) on an idle batcher at timeout_ms 5
   and 0, as the latency added over the no-op function's own time;
5. idle CPU: one call, then the process's CPU time over ~2 s of idleness, in % of one core.

Functions: ``noop`` returns its input list; ``model`` sleeps 2 ms + 50 us per item (a stand-in
for a model whose cost is mostly fixed per batch) and returns its inputs.

Usage::

    python scripts/bench_inprocess.py            # full run (~3-5 min)
    python scripts/bench_inprocess.py --quick    # smoke run (< 30 s)
    python scripts/bench_inprocess.py --out bench.md --repeats 5

fast-dynamic-batcher runs its model in a spawned process, which imports this file as a module:
keep everything that runs under ``main()``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import os
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Run from a checkout without installing batchline: its repository root goes first on the path
# (a spawned fast-dynamic-batcher process inherits sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import batched
import batched.aio
from _harness import Samples, load, log, machine, provenance, ratio, versions, watchdog
from fast_dynamic_batcher.dyn_batcher import DynBatcher
from fast_dynamic_batcher.inference_template import InferenceModel

import batchline
import batchline.aio

BATCH_SIZE = 32
THREADS = 64
TASKS = 1000

# -- the batch functions -------------------------------------------------------------------------


def noop(items: list[Any]) -> list[Any]:
    return items


async def anoop(items: list[Any]) -> list[Any]:
    return items


def model(items: list[Any]) -> list[Any]:
    time.sleep(0.002 + 0.00005 * len(items))
    return items


FUNCTIONS: dict[str, Callable[[list[Any]], list[Any]]] = {"noop": noop, "model": model}


# fast-dynamic-batcher runs ``infer`` in its own process: there is no stats object there, so
# every output carries the size of its batch; a batch of n gives n outputs worth 1/n each,
# whence batches = sum(1/n) over all items.
class NoopModel(InferenceModel):
    def infer(self, inputs: list[Any]) -> list[Any]:
        n = len(inputs)
        return [(x, n) for x in noop(inputs)]


class SleepModel(InferenceModel):
    def infer(self, inputs: list[Any]) -> list[Any]:
        n = len(inputs)
        return [(x, n) for x in model(inputs)]


FDB_MODELS: dict[str, type[InferenceModel]] = {"noop": NoopModel, "model": SleepModel}


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

IMPL_NAMES = {
    "batchline": "batchline",
    "batched": "batched 0.1.5",
    "fdb": "fast-dynamic-batcher 1.1.0",
    "none": "no batching",
    "none-serial": "no batching, fn serialised",
}


# -- small helpers ----------------------------------------------------------------------------------


def rounded_up(n: int, unit: int) -> int:
    return max(unit, -(-n // unit) * unit)


def fmt_rate(x: float | None) -> str:
    if x is None:
        return "—"
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    if x >= 1e3:
        return f"{x / 1e3:.1f} k"
    return f"{x:.0f}"


def fmt_ratio(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "—"
    return f"{x * 100:.1f} %" if pct else f"{x:.2f}x"


@contextlib.contextmanager
def closing_all(closers: list[Callable[[], Any]]) -> Iterator[None]:
    try:
        yield
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:
                log(f"  warning: closing failed: {exc!r}")


def stop_fdb(dyn: DynBatcher) -> None:
    """``DynBatcher.stop``, but bounded: a child that does not exit is terminated."""
    dyn.event.set()
    dyn.shared_bool.value = False
    dyn._batcher.join(5)
    if dyn._batcher.is_alive():
        dyn._batcher.terminate()
        dyn._batcher.join(5)
    dyn.thread.join(5)
    for q in (dyn._input_queue, dyn._output_queue):
        q.cancel_join_thread()
        q.close()


async def stop_batched_aio(proc: Any) -> None:
    task = getattr(proc, "_task", None)
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    proc._loop = None


# -- throughput harnesses ----------------------------------------------------------------------------


@dataclass
class CellResult:
    rate: float
    batch: float | None
    errors: int = 0


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
                r = (await acall(i)) if awaited else acall(i)  # type: ignore[misc]
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
    return r == i


def same_list(i: int, r: Any) -> bool:
    return r == [i]


# -- throughput cells ---------------------------------------------------------------------------------


def thread_cell(impl: str, fname: str, n: int) -> CellResult:
    fn = FUNCTIONS[fname]
    if impl == "batchline":
        f = batchline.dynamically(batch_size=BATCH_SIZE, timeout_ms=5.0)(fn)
        with closing_all([f.close]):
            f(-1)  # starts the worker
            rate, bad = drive_threads(f, n, same)
            batch = f.stats.mean_batch_size  # includes the one warm-up batch of 1
        return CellResult(rate, batch, bad)
    if impl == "batched":
        p = batched.dynamically(batch_size=BATCH_SIZE, timeout_ms=5.0)(fn)
        with closing_all([p.shutdown]):
            p(-1)
            rate, bad = drive_threads(p, n, same)
            batch = p.stats.avg_batch_size
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
    if impl == "batchline":
        f = batchline.aio.dynamically(batch_size=BATCH_SIZE, timeout_ms=5.0)(fn)
        try:
            await f(-1)
            rate, bad = await drive_tasks(f, n, same)
            batch = f.stats.mean_batch_size
        finally:
            await f.aclose()
        return CellResult(rate, batch, bad)
    if impl == "batched":
        p = batched.aio.dynamically(batch_size=BATCH_SIZE, timeout_ms=5.0)(fn)
        try:
            await p(-1)
            rate, bad = await drive_tasks(p, n, same)
            batch = p.stats.avg_batch_size
        finally:
            await stop_batched_aio(p)
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


# -- latency and idle CPU ------------------------------------------------------------------------------


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
    if impl == "batchline":
        f: Any = batchline.dynamically(batch_size=BATCH_SIZE, timeout_ms=timeout_ms)(noop)
        close = f.close
    else:
        f = batched.dynamically(batch_size=BATCH_SIZE, timeout_ms=timeout_ms)(noop)
        close = f.shutdown
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
    if impl == "batchline":
        f: Any = batchline.aio.dynamically(batch_size=BATCH_SIZE, timeout_ms=timeout_ms)(fn)
    else:
        f = batched.aio.dynamically(batch_size=BATCH_SIZE, timeout_ms=timeout_ms)(fn)
    try:
        for i in range(10):
            await f(i)
        for i in range(calls):
            t0 = time.perf_counter()
            await f(i)
            samples.append(time.perf_counter() - t0)
    finally:
        if impl == "batchline":
            await f.aclose()
        else:
            await stop_batched_aio(f)
    return samples


def cpu_pct_over(seconds: float, idle: Callable[[float], Any]) -> float:
    c0, w0 = time.process_time(), time.perf_counter()
    idle(seconds)
    c1, w1 = time.process_time(), time.perf_counter()
    return (c1 - c0) / (w1 - w0) * 100


def idle_cpu_thread(impl: str, timeout_ms: float | None, seconds: float) -> float:
    if impl == "baseline":
        return cpu_pct_over(seconds, time.sleep)
    if impl == "batchline":
        f: Any = batchline.dynamically(batch_size=BATCH_SIZE, timeout_ms=timeout_ms)(noop)
        close = f.close
    else:
        f = batched.dynamically(batch_size=BATCH_SIZE, timeout_ms=timeout_ms)(noop)
        close = f.shutdown
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
    if impl == "batchline":
        f: Any = batchline.aio.dynamically(batch_size=BATCH_SIZE, timeout_ms=timeout_ms)(noop)
        try:
            await f(0)
            await asyncio.sleep(0.05)
            return await idle()
        finally:
            await f.aclose()
    p = batched.aio.dynamically(batch_size=BATCH_SIZE, timeout_ms=timeout_ms)(noop)
    try:
        await p(0)
        await asyncio.sleep(0.05)
        return await idle()
    finally:
        await stop_batched_aio(p)


# -- the run --------------------------------------------------------------------------------------------

THROUGHPUT_ROWS: list[tuple[str, str, str, list[str]]] = [
    # (api, function key, row label, implementations)
    ("thread", "noop", "no-op", ["batchline", "batched", "none"]),
    ("thread", "model", "model-like", ["batchline", "batched", "none", "none-serial"]),
    ("aio", "noop", "no-op (sync fn)", ["batchline", "batched", "fdb", "none"]),
    ("aio", "anoop", "no-op (async fn)", ["batchline", "batched"]),
    ("aio", "model", "model-like", ["batchline", "batched", "fdb", "none"]),
]


Cell = tuple[str, str, str]  # (API, function, implementation)


def _row(figure: str, key: Cell) -> str:
    return " ".join((figure, *key))


@dataclass
class Results(Samples):
    """The repeats of each throughput cell (its rate and mean batch, as Samples' rows
    ``rate <api> <fn> <impl>`` and ``batch ...``, and ``ideal``), and the other parts."""

    errors: dict[Cell, int] = field(default_factory=dict)
    latency: dict[tuple[str, str, float], tuple[float, float]] = field(default_factory=dict)
    own_time_us: float = 0.0
    idle_cpu: dict[tuple[str, str, float | None], float] = field(default_factory=dict)
    load_before: str = ""
    load_after: str = ""
    provenance_before: str = ""
    provenance_after: str = ""
    wall_s: float = 0.0

    def add_cell(self, key: Cell, cell: CellResult) -> None:
        self.add(_row("rate", key), cell.rate)
        self.add(_row("batch", key), cell.batch)
        self.errors[key] = self.errors.get(key, 0) + cell.errors

    def rates(self, key: Cell) -> list[float]:
        return self.rows.get(_row("rate", key), [])

    def median_rate(self, key: Cell) -> float | None:
        return self.med(_row("rate", key))

    def paired_ratios(self, key_a: Cell, key_b: Cell) -> list[float]:
        return self.paired(_row("rate", key_a), _row("rate", key_b))

    def median_batch(self, key: Cell) -> float | None:
        return self.med(_row("batch", key))


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


def run_aio(fn: Callable[..., Awaitable[list[float]]], *args: Any) -> list[float]:
    return asyncio.run(fn(*args))


def run_latency(res: Results, calls: int) -> None:
    log("latency (single caller, idle batcher)")
    res.own_time_us = own_time_s() * 1e6
    own = res.own_time_us / 1e6
    for timeout_ms in (5.0, 0.0):
        configs: list[tuple[str, str, Callable[[], list[float]]]] = [
            (impl, "thread", functools.partial(latency_thread, impl, timeout_ms, calls))
            for impl in ("batchline", "batched")
        ]
        configs += [
            (impl, api, functools.partial(run_aio, latency_aio, impl, fname, timeout_ms, calls))
            for impl, api, fname in (
                ("batchline", "aio (sync fn)", "noop"),
                ("batchline", "aio (async fn)", "anoop"),
                ("batched", "aio (sync fn)", "noop"),
                ("batched", "aio (async fn)", "anoop"),
                ("fdb", "aio", "noop"),
            )
        ]
        for impl, api, measure in configs:
            samples = [s - own for s in measure()]
            res.latency[(impl, api, timeout_ms)] = percentiles_ms(samples)
            p50, p99 = res.latency[(impl, api, timeout_ms)]
            log(
                f"  {impl:9} {api:15} timeout_ms={timeout_ms:g}: p50 {p50:.3f} ms, p99 {p99:.3f} ms"
            )


def run_idle_cpu(res: Results, seconds: float) -> None:
    log(f"idle CPU ({seconds:g} s each)")
    res.idle_cpu[("baseline", "thread", None)] = idle_cpu_thread("baseline", None, seconds)
    res.idle_cpu[("baseline", "aio", None)] = asyncio.run(idle_cpu_aio("baseline", None, seconds))
    for timeout_ms in (5.0, 0.0):
        for impl in ("batchline", "batched"):
            gc.collect()
            res.idle_cpu[(impl, "thread", timeout_ms)] = idle_cpu_thread(impl, timeout_ms, seconds)
            res.idle_cpu[(impl, "aio", timeout_ms)] = asyncio.run(
                idle_cpu_aio(impl, timeout_ms, seconds)
            )
    for (impl, api, t), pct in res.idle_cpu.items():
        log(f"  {impl:9} {api:6} timeout_ms={t}: {pct:.2f} %")


# -- report ----------------------------------------------------------------------------------------------


def report(res: Results, args: argparse.Namespace) -> str:
    ideal = res.med("ideal")
    out: list[str] = []
    w = out.append
    w("## In-process benchmark: batchline vs batched vs fast-dynamic-batcher\n")
    w(
        f"- command: `python scripts/bench_inprocess.py {' '.join(sys.argv[1:])}`".rstrip()
        + f"; {args.repeats} repeat(s) per throughput cell, median shown"
        + (" (**--quick smoke run: not representative**)" if args.quick else "")
    )
    w(
        f"- machine: {machine(res.load_before, res.load_after)} "
        "(shared machine: other work may run concurrently)"
    )
    changed = (
        ""
        if res.provenance_before == res.provenance_after
        else f" (**batchline changed during the run**; at the end: {res.provenance_after})"
    )
    w(f"- batchline measured: {res.provenance_before}{changed}")
    w(
        f"- versions: batchline {batchline.__version__}, "
        f"{versions('batched', 'fast-dynamic-batcher', 'numpy')}"
    )
    w(
        f"- batch_size {BATCH_SIZE}, timeout_ms 5 (max_delay 5 ms for fast-dynamic-batcher); "
        f"{THREADS} caller threads (thread API), {TASKS} asyncio tasks (aio API); "
        f"model-like fn = sleep(2 ms + 50 us x items); run took {res.wall_s:.0f} s\n"
    )

    w("### Throughput (items/s, median)\n")
    w(
        "| API | function | batchline | batched | fast-dynamic-batcher | no batching "
        "| batchline / batched | paired per repeat | batchline share of ideal "
        "| batched share of ideal |"
    )
    w("|---|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for api, fname, label, _impls in THROUGHPUT_ROWS:
        bl = res.median_rate((api, fname, "batchline"))
        bd = res.median_rate((api, fname, "batched"))
        fdb = res.median_rate((api, fname, "fdb"))
        none = res.median_rate((api, fname, "none"))
        model_row = fname == "model"
        paired = res.paired_ratios((api, fname, "batchline"), (api, fname, "batched"))
        paired_txt = (
            f"{statistics.median(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f})"
            if paired
            else "—"
        )
        w(
            f"| {api} | {label} | {fmt_rate(bl)} | {fmt_rate(bd)} | {fmt_rate(fdb)} "
            f"| {fmt_rate(none)} | {fmt_ratio(ratio(bl, bd))} | {paired_txt} "
            f"| {fmt_ratio(ratio(bl, ideal), True) if model_row else '—'} "
            f"| {fmt_ratio(ratio(bd, ideal), True) if model_row else '—'} |"
        )
    serial = res.median_rate(("thread", "model", "none-serial"))
    w(
        "\n'batchline / batched' is the ratio of the medians; 'paired per repeat' is the median "
        "(and range) of the ratios within each repeat (the implementations alternate within a "
        "repeat, so a pair shares the machine's load at that moment). The aio no-op is run "
        "twice: with the plain (sync) no-op function (batched runs it on a helper thread per "
        "batch; batchline on its own thread until 16 calls in a row were quick, then on the "
        "loop, see inline_below_ms), and with an `async def` no-op, awaited on the loop."
    )
    w(
        f"\nIdeal (model-like fn called back to back on full batches of {BATCH_SIZE}, no "
        f"batcher, same run): **{fmt_rate(ideal)} items/s** "
        f"(repeats: {', '.join(fmt_rate(x) for x in res.rows['ideal'])})."
    )
    fdb_model = res.median_rate(("aio", "model", "fdb"))
    w(
        f"fast-dynamic-batcher share of ideal: {fmt_ratio(ratio(fdb_model, ideal), True)}. "
        f"No batching with the model-like fn: `time.sleep` overlaps freely across threads, so "
        f"unbatched calls from 64 threads are not serialised as on one device; with the calls "
        f"serialised by a lock (one device) it is {fmt_rate(serial)} items/s. The aio "
        "'no batching' model-like cell goes through `asyncio.to_thread` (default executor, "
        f"{min(32, (os.cpu_count() or 1) + 4)} threads); fast-dynamic-batcher's "
        "`process_batched` also goes through `asyncio.to_thread`, which caps the calls in "
        "flight (hence its batch sizes).\n"
    )

    w("### Mean batch size (median over repeats)\n")
    w("| API | function | batchline | batched | fast-dynamic-batcher |")
    w("|---|---|---:|---:|---:|")
    for api, fname, label, _impls in THROUGHPUT_ROWS:
        cols = []
        for impl in ("batchline", "batched", "fdb"):
            b = res.median_batch((api, fname, impl))
            cols.append("—" if b is None else f"{b:.1f}")
        w(f"| {api} | {label} | {' | '.join(cols)} |")
    w("")

    w("### All throughput repeats (items/s)\n")
    w("| API | function | implementation | items | repeats | median | spread (max/min) |")
    w("|---|---|---|---:|---|---:|---:|")
    for api, fname, label, impls in THROUGHPUT_ROWS:
        for impl in impls:
            rates = res.rates((api, fname, impl))
            if not rates:
                continue
            unit = THREADS if api == "thread" else TASKS
            n = rounded_up(COUNTS[(api, fname, impl)] // args.scale, unit)
            errs = res.errors.get((api, fname, impl), 0)
            w(
                f"| {api} | {label} | {IMPL_NAMES[impl]} | {n} "
                f"| {', '.join(fmt_rate(x) for x in rates)} | {fmt_rate(statistics.median(rates))} "
                f"| {max(rates) / min(rates):.2f}{' **WRONG RESULTS: ' + str(errs) + '**' if errs else ''} |"
            )
    w("")

    w(
        f"### Single-caller latency on an idle batcher (no-op fn; added over the fn's own "
        f"{res.own_time_us:.2f} us; {args.latency_calls} sequential calls)\n"
    )
    w("| implementation | API | timeout_ms | p50 added (ms) | p99 added (ms) |")
    w("|---|---|---:|---:|---:|")
    for (impl, api, t), (p50, p99) in res.latency.items():
        w(f"| {IMPL_NAMES[impl]} | {api} | {t:g} | {p50:.3f} | {p99:.3f} |")
    w("")

    w(
        f"### Idle CPU (one call, then {args.idle_seconds:g} s idle; process CPU time in % of "
        "one core)\n"
    )
    w("| implementation | API | timeout_ms | idle CPU |")
    w("|---|---|---:|---:|")
    for (impl, api, t), pct in res.idle_cpu.items():
        name = "nothing (baseline)" if impl == "baseline" else IMPL_NAMES[impl]
        w(f"| {name} | {api} | {'—' if t is None else f'{t:g}'} | {pct:.2f} % |")
    w("")

    w("### Targets (batchline)\n")
    w("| target | measured | met |")
    w("|---|---|---|")

    def target(name: str, measured: str, ok: bool | None) -> None:
        w(f"| {name} | {measured} | {'n/a' if ok is None else ('yes' if ok else '**NO**')} |")

    for api, fname, label in (
        ("thread", "noop", "thread API"),
        ("aio", "noop", "aio API, sync fn"),
        ("aio", "anoop", "aio API, async fn"),
    ):
        r = ratio(
            res.median_rate((api, fname, "batchline")), res.median_rate((api, fname, "batched"))
        )
        paired = res.paired_ratios((api, fname, "batchline"), (api, fname, "batched"))
        extra = f" (paired median {statistics.median(paired):.2f}x)" if paired else ""
        target(
            f"no-op throughput >= 2x batched ({label})",
            fmt_ratio(r) + extra,
            None if r is None else r >= 2,
        )
    for api in ("thread", "aio"):
        s = ratio(res.median_rate((api, "model", "batchline")), ideal)
        target(
            f"model-like throughput >= 97 % of ideal ({api} API)",
            fmt_ratio(s, True),
            None if s is None else s >= 0.97,
        )
    for impl_api in ("thread", "aio (sync fn)", "aio (async fn)"):
        lat = res.latency.get(("batchline", impl_api, 0.0))
        target(
            f"timeout_ms=0 idle single-caller added latency p50 <= 0.3 ms ({impl_api})",
            "—" if lat is None else f"{lat[0]:.3f} ms",
            None if lat is None else lat[0] <= 0.3,
        )
    for api in ("thread", "aio"):
        base = res.idle_cpu.get(("baseline", api, None), 0.0)
        for t in (5.0, 0.0):
            pct = res.idle_cpu.get(("batchline", api, t))
            # process_time has some noise of its own: judged net of the no-batcher baseline.
            target(
                f"idle CPU 0.0 % ({api} API, timeout_ms={t:g}; net of baseline)",
                "—" if pct is None else f"{pct:.2f} % (baseline {base:.2f} %)",
                None if pct is None else pct - base < 0.05,
            )
    w("")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny counts (< 30 s)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="repeats per throughput cell (median)"
    )
    parser.add_argument("--out", type=Path, help="also write the markdown report to this file")
    parser.add_argument(
        "--only",
        choices=["throughput", "latency", "idle"],
        action="append",
        help="run only these parts (repeatable; default: all)",
    )
    parser.add_argument("--max-seconds", type=float, default=None, help="abort after this long")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    args.scale = QUICK_DIVISOR if args.quick else 1
    if args.quick:
        args.repeats = min(args.repeats, 1)
    args.latency_calls = 30 if args.quick else 300
    args.idle_seconds = 0.5 if args.quick else 2.0
    watchdog(args.max_seconds or (120 if args.quick else 900), "bench_inprocess")
    parts = set(args.only or ["throughput", "latency", "idle"])

    res = Results(load_before=load(), provenance_before=provenance())
    t0 = time.perf_counter()
    if "idle" in parts:
        run_idle_cpu(res, args.idle_seconds)
    if "latency" in parts:
        run_latency(res, args.latency_calls)
    if "throughput" in parts:
        run_throughput(res, args.repeats, args.scale)
    else:
        res.add("ideal", ideal_rate(max(10, IDEAL_BATCHES // args.scale)))
    res.wall_s = time.perf_counter() - t0
    res.load_after = load()
    res.provenance_after = provenance()

    text = report(res, args)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
        log(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
