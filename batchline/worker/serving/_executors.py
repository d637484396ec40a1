"""What runs a worker's model: the asyncio batcher, or continuous batching for generation.

:func:`build` chooses from the model and the settings and returns both executors a worker
holds: the main one, and the one that runs a redelivered entry alone. Every model call runs
through the worker's :class:`~batchline.worker.shared._guard.Guard` (the watchdog sees it),
and the calls that start are told to its :class:`~._starts.Starts`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchline.config import WorkerSettings
from batchline.drivers._aio import AioBatcher
from batchline.drivers._base import BatchConfig
from batchline.worker.models import CountsPadding, Model, Prepared
from batchline.worker.models._lazy import LazyModel
from batchline.worker.serving._generation_executor import GenerationExecutor, GenerationModel
from batchline.worker.serving._starts import Starts
from batchline.worker.shared._guard import Guard, work_of
from batchline.worker.shared._roles import Executor

if TYPE_CHECKING:
    from batchline.tracing._otel import WorkerTrace

__all__ = ["Executors", "build", "pads"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Executors:
    """The executors of one worker and how many entries it may hold for them."""

    main: Executor
    alone: Executor
    window: int  # entries the worker may hold (read ahead) at once


def pads(model: Model) -> bool:
    """Whether ``model`` pads its batches (an optional attribute; by default it does)."""
    return bool(getattr(model, "pads", True))


def build(model: Model, s: WorkerSettings, *, guard: Guard, starts: Starts) -> Executors:
    """The executors for ``model``: see the module docstring."""
    if isinstance(model, GenerationModel) or (
        isinstance(model, LazyModel) and isinstance(model.inner, GenerationModel)
    ):  # continuous batching instead
        gen = GenerationExecutor(model, s, guard=guard, starts=starts)
        if s.cache_ttl_s > 0:
            logger.warning(
                "cache_ttl_s=%s on a generation queue: identical requests share one "
                "answer, also sampled ones without a seed",
                s.cache_ttl_s,
            )
        return Executors(gen, gen.alone, gen.window)
    infer = _infer(model, guard, starts.trace)
    # One lock for both batchers: a redelivered entry never runs beside a batch.
    model_lock = threading.Lock()
    # No batch is handed to the model's thread ahead of time: cancellations and deadlines
    # are checked as a batch starts, which must be when the model is free to run it (a real
    # model's batch takes far longer than the wait this would save).
    batcher: AioBatcher[Prepared, Any] = AioBatcher(
        infer,
        BatchConfig(
            batch_size=s.batch_size,
            timeout_ms=s.timeout_ms,
            target_p99_ms=s.target_p99_ms,
            small_batch_threshold=0,
            max_tokens=s.max_tokens,
            length_fn=_length,
            # Grouping similar lengths pays only where the model pads (optional attribute).
            group_by_length=pads(model),
            group_window=s.read_ahead,
        ),
        max_concurrent_batches=1,
        on_batch_start=starts.before_batch,
        lock=model_lock,
    )
    # Entries delivered more than once run here, alone, never inline on the loop (the
    # model's lock may be held by a batch of the main batcher).
    alone: AioBatcher[Prepared, Any] = AioBatcher(
        infer,
        BatchConfig(batch_size=1, timeout_ms=0, small_batch_threshold=0, inline_below_ms=0),
        max_concurrent_batches=1,
        on_batch_start=starts.before_batch,
        lock=model_lock,
    )
    # A coroutine model's call waits on its batcher's thread for the loop: never inline.
    guard.off_loop.append(batcher.keep_off_loop)
    if isinstance(model, CountsPadding):  # its padding figures reach the stats
        model.count_padding(batcher.record_padding)
    return Executors(batcher, alone, s.batch_size * s.read_ahead)


def _infer(
    model: Model, guard: Guard, trace: WorkerTrace | None
) -> Callable[[list[Prepared]], Any]:
    """The batch function: one model call to its end (a coroutine model's too:
    :meth:`Guard.infer`), stamped and timed by ``guard`` (and in its span, tracing on)."""
    padded = pads(model)

    def infer(batch: list[Prepared]) -> Any:
        work = work_of(batch, pads=padded)
        payloads = [p.payload for p in batch]
        if trace is not None:
            return guard.call(
                lambda: trace.model_call(batch, lambda: guard.infer(model, payloads)), work
            )
        return guard.call(lambda: guard.infer(model, payloads), work)

    return infer


def _length(prepared: Prepared) -> int:
    return prepared.length
