"""The roles a worker's serving path and its upkeep meet through, as protocols: the
:class:`Executor` that runs the model (the asyncio batcher, or continuous batching for
generation: :mod:`batchline.worker.serving._executors`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from batchline.core.stats import BatchStats
from batchline.drivers._base import Call

__all__ = ["Executor"]


class Executor(Protocol):
    """What a worker needs of whatever runs its requests (a batcher, or generation)."""

    def enqueue(
        self,
        payloads: list[Any],
        wake: Callable[[Call], None],
        *,
        deadline: float | None = None,
        priority: int = 0,
    ) -> Call: ...

    @property
    def queue_size(self) -> int: ...

    @property
    def stats(self) -> BatchStats: ...

    async def aclose(self, *, drain: bool = True) -> None: ...

    def close(self) -> None: ...
