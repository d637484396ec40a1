"""The worker's preparing side: decode, validate and preprocess (tokenize) what it reads.

For a model whose preprocessing is heavy (the tokenizer models), reads are prepared on
threads of their own, so that tokenizing the next batches overlaps the current batch's
compute on the model's thread: the reader brings in up to ``read_ahead`` batches ahead, and
each read is prepared as it arrives. With ``prep_threads`` > 1 a read is split across that
many threads (the fast tokenizers encode a list without holding the GIL), for a model fast
enough (a GPU) that one thread's tokenizing would cap the served rate. A light model is
prepared inline on the event loop.

The time spent preparing (each thread's wall time, summed over the threads) and the
requests prepared are counted, for the worker's statistics (``prepare``): beside the model's
time per batch they tell whether preparing keeps up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

from batchline.transport.codec import Limits
from batchline.worker._answers import Outcome, prepare, warm_up
from batchline.worker._readcap import Entry
from batchline.worker.models import Model

__all__ = ["Outcome", "Preparer"]


class Preparer:
    """Prepares the entries of one read: ``await preparer(entries)``, in order."""

    def __init__(self, model: Model, limits: Limits, worker_id: str, *, threads: int) -> None:
        self._model = model
        self._limits = limits
        self._worker_id = worker_id
        self._threads = threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.seconds = 0.0  # preparing (wall), summed over the threads
        self.requests = 0
        self.preparing = 0  # entries being prepared now (they hold room in the window)

    def start(self) -> None:
        """Start the threads, if the model's preprocessing is heavy (once it is loaded),
        after one preprocess here (:func:`~._answers.warm_up`)."""
        if self._model.heavy_preprocess and self._pool is None:
            warm_up(self._model)
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._threads, thread_name_prefix="batchline-prep"
            )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def stats(self) -> dict[str, Any]:
        """Seconds spent preparing (summed over the threads) and requests prepared so far."""
        return {
            "seconds": round(self.seconds, 6),
            "requests": self.requests,
            "threads": self._threads if self._pool is not None else 0,
        }

    async def __call__(self, batch: list[Entry]) -> list[Outcome]:
        self.preparing += len(batch)
        try:
            return await self._prepare_all(batch)
        finally:
            self.preparing -= len(batch)

    async def _prepare_all(self, batch: list[Entry]) -> list[Outcome]:
        if self._pool is None:
            outcomes, took = self._prepare(batch)
            self._count(took, len(batch))
            return outcomes
        if not batch:  # every entry of the read was too large: dead-lettered unread
            return []
        loop = asyncio.get_running_loop()
        size = -(-len(batch) // min(self._threads, len(batch)))
        chunks = [batch[i : i + size] for i in range(0, len(batch), size)]
        done = await asyncio.gather(
            *(loop.run_in_executor(self._pool, self._prepare, chunk) for chunk in chunks)
        )
        self._count(sum(took for _, took in done), len(batch))
        return [outcome for outcomes, _ in done for outcome in outcomes]

    def _prepare(self, batch: list[Entry]) -> tuple[list[Outcome], float]:
        started = time.perf_counter()
        outcomes = prepare(batch, self._model, self._limits, self._worker_id)
        return outcomes, time.perf_counter() - started

    def _count(self, seconds: float, requests: int) -> None:
        self.seconds += seconds
        self.requests += requests
