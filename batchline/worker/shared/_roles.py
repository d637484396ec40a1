"""The roles a worker's serving path and its upkeep meet through, as protocols: the
:class:`Executor` that runs the model (the asyncio batcher, or continuous batching for
generation: :mod:`batchline.worker.serving._executors`), and the :class:`Entrance` where the
entries it takes go in (:class:`~batchline.worker.serving._serving.Serving`), which the
reader and the reclaimer hand them to."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from batchline.core.stats import BatchStats
from batchline.drivers._base import Call
from batchline.worker.shared._held import Entry

__all__ = ["Entrance", "Executor"]


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


class Entrance(Protocol):
    """Where a worker's entries go in: the serving path, as the reader and the reclaimer
    see it."""

    @property
    def open(self) -> bool:
        """Whether the worker reads and reclaims now: not stopping, not hung, and no model
        call running long."""

    def room(self) -> int:
        """How many more entries may come in now (none while it is not :attr:`open`)."""

    async def accept(self, entries: Iterable[Entry], *, alone: bool = False) -> None:
        """Take these entries in (held, prepared, submitted; ``alone``: each runs alone)."""

    def refuse(
        self, sidx: int, entry: bytes, raw: dict[bytes, bytes], kind: str, reason: str
    ) -> None:
        """Dead-letter one entry (unread: too large; or delivered too often)."""

    def prepare_stats(self) -> dict[str, Any]:
        """Its preparing so far: seconds (summed over the threads), requests, threads."""
