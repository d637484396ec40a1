"""Coalesced writes: one write in flight, the next takes everything that waited meanwhile.

The producer's submits and the worker's answers both go to Redis this way: what arrives
while a write is in flight waits here, and the next write carries all of it (up to
``max_batch``), the same coalescing as a batcher with timeout 0 without its per-item cost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Outbox"]

T = TypeVar("T")


class Outbox(Generic[T]):
    """Items waiting for the next write, and the one task that writes them.

    Args:
        write: writes one batch of items; it handles its own failures (an exception it
            lets through ends the task, and the items waiting go to ``abandon``).
        max_batch: most items per write (None: all that wait).
        abandon: given the items that will never be written (the task was cancelled, as
            when the event loop closes); default: they are dropped.
        name: the writing task's name.
    """

    def __init__(
        self,
        write: Callable[[list[T]], Awaitable[None]],
        *,
        max_batch: int | None = None,
        abandon: Callable[[list[T]], None] | None = None,
        name: str = "batchline-writer",
    ) -> None:
        self._write = write
        self._max_batch = max_batch
        self._abandon = abandon
        self._name = name
        self._waiting: list[T] = []
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[T]:
        """The items waiting for the next write (not those of the write in flight)."""
        return iter(self._waiting)

    @property
    def busy(self) -> bool:
        """Whether a write is in flight (or about to start)."""
        return self._task is not None

    def put(self, item: T) -> None:
        """Queue ``item`` for the next write; start writing if nothing is in flight (on the
        running event loop)."""
        self._waiting.append(item)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    async def drain(self) -> None:
        """Return once everything put so far is written (or abandoned). Cancelling the
        caller does not cancel the write."""
        while self._task is not None:
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        try:
            while self._waiting:
                n = self._max_batch or len(self._waiting)
                batch, self._waiting = self._waiting[:n], self._waiting[n:]
                await self._write(batch)
        finally:
            self._task = None
            if self._waiting and self._abandon is not None:
                left, self._waiting = self._waiting, []
                self._abandon(left)
