"""What the parts of the in-process benchmark share: the batch functions, the batchers under
test, closers and results.

fast-dynamic-batcher runs its model (``NoopModel``, ``SleepModel``) in a spawned process, which
imports this module by name: nothing here runs at import beyond definitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import batched
import batched.aio
from fast_dynamic_batcher.dyn_batcher import DynBatcher
from fast_dynamic_batcher.inference_template import InferenceModel

import batchline
import batchline.aio
from benchmarks.harness import Samples, log

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
# whence batches = sum(1/n) over all items. fast-dynamic-batcher ships no type information, so
# InferenceModel is Any to mypy: hence the two ignores.
class NoopModel(InferenceModel):  # type: ignore[misc]
    def infer(self, inputs: list[Any]) -> list[Any]:
        n = len(inputs)
        return [(x, n) for x in noop(inputs)]


class SleepModel(InferenceModel):  # type: ignore[misc]
    def infer(self, inputs: list[Any]) -> list[Any]:
        n = len(inputs)
        return [(x, n) for x in model(inputs)]


FDB_MODELS: dict[str, type[InferenceModel]] = {"noop": NoopModel, "model": SleepModel}

IMPL_NAMES = {
    "batchline": "batchline",
    "batched": "batched 0.1.5",
    "fdb": "fast-dynamic-batcher 1.1.0",
    "none": "no batching",
    "none-serial": "no batching, fn serialised",
}


# -- small helpers ----------------------------------------------------------------------------------


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


def thread_batcher(
    impl: str, fn: Callable[..., Any], timeout_ms: float
) -> tuple[Any, Callable[[], Any]]:
    """batchline's or batched's (``impl``) thread-API batcher around ``fn``, and its closer."""
    if impl == "batchline":
        f: Any = batchline.dynamically(batch_size=BATCH_SIZE, timeout_ms=timeout_ms)(fn)
        return f, f.close
    p: Any = batched.dynamically(batch_size=BATCH_SIZE, timeout_ms=timeout_ms)(fn)
    return p, p.shutdown


def aio_batcher(
    impl: str, fn: Callable[..., Any], timeout_ms: float
) -> tuple[Any, Callable[[], Awaitable[None]]]:
    """batchline's or batched's (``impl``) aio-API batcher around ``fn``, and its closer."""
    if impl == "batchline":
        f: Any = batchline.aio.dynamically(batch_size=BATCH_SIZE, timeout_ms=timeout_ms)(fn)
        return f, f.aclose
    p: Any = batched.aio.dynamically(batch_size=BATCH_SIZE, timeout_ms=timeout_ms)(fn)
    return p, functools.partial(stop_batched_aio, p)


def mean_batch(impl: str, batcher: Any) -> float | None:
    """The mean batch size in the batcher's own statistics (batchline's or batched's)."""
    stats = batcher.stats
    mean: float | None = stats.mean_batch_size if impl == "batchline" else stats.avg_batch_size
    return mean


# -- results ---------------------------------------------------------------------------------------


@dataclass
class CellResult:
    rate: float
    batch: float | None
    errors: int = 0


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
