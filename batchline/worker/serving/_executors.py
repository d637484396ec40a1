"""What runs a worker's model: the asyncio batcher, or continuous batching for generation.

:func:`build` chooses from the model and the settings and returns both executors a worker
holds: the main one, and the one that runs a redelivered entry alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from batchline.config import WorkerSettings
from batchline.drivers._aio import AioBatcher
from batchline.drivers._base import BatchConfig, Call, Item
from batchline.worker.models import CountsPadding, Model, Prepared
from batchline.worker.serving._generation_executor import (
    Executor,
    GenerationExecutor,
    GenerationModel,
)

__all__ = ["Executors", "Hooks", "build"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Hooks:
    """The worker's side of running a batch."""

    infer: Callable[[list[Prepared]], Any]  # the model's outputs for one batch
    before_batch: Callable[[list[Item]], Awaitable[None]]  # may reject cancelled items
    guard: Callable[[Callable[[], Any]], Any]  # runs one model call under the watchdog
    mark_started: Callable[[list[Call], int], None]  # these calls start, in a batch of n
    cancelled: Callable[[Call], bool]  # whether a call's producer cancelled it


@dataclass(frozen=True, slots=True)
class Executors:
    """The executors of one worker and how many entries it may hold for them."""

    main: Executor
    alone: Executor
    window: int  # entries the worker may hold (read ahead) at once


def build(model: Model, s: WorkerSettings, hooks: Hooks) -> Executors:
    """The executors for ``model``: see the module docstring."""
    if isinstance(model, GenerationModel):  # continuous batching instead
        gen = GenerationExecutor(
            model,
            s,
            guard=hooks.guard,
            on_start=hooks.mark_started,
            cancelled=hooks.cancelled,
        )
        if s.cache_ttl_s > 0:
            logger.warning(
                "cache_ttl_s=%s on a generation queue: identical requests share one "
                "answer, also sampled ones without a seed",
                s.cache_ttl_s,
            )
        return Executors(gen, gen.alone, gen.window)
    # One lock for both batchers: a redelivered entry never runs beside a batch.
    model_lock = threading.Lock()
    # No batch is handed to the model's thread ahead of time: cancellations and deadlines
    # are checked as a batch starts, which must be when the model is free to run it (a real
    # model's batch takes far longer than the wait this would save).
    batcher: AioBatcher[Prepared, Any] = AioBatcher(
        hooks.infer,
        BatchConfig(
            batch_size=s.batch_size,
            timeout_ms=s.timeout_ms,
            target_p99_ms=s.target_p99_ms,
            small_batch_threshold=0,
            max_tokens=s.max_tokens,
            length_fn=_length,
            # Grouping similar lengths pays only where the model pads (optional attribute).
            group_by_length=bool(getattr(model, "pads", True)),
            group_window=s.read_ahead,
        ),
        max_concurrent_batches=1,
        on_batch_start=hooks.before_batch,
        lock=model_lock,
    )
    # Entries delivered more than once run here, alone, never inline on the loop (the
    # model's lock may be held by a batch of the main batcher).
    alone: AioBatcher[Prepared, Any] = AioBatcher(
        hooks.infer,
        BatchConfig(batch_size=1, timeout_ms=0, small_batch_threshold=0, inline_below_ms=0),
        max_concurrent_batches=1,
        on_batch_start=hooks.before_batch,
        lock=model_lock,
    )
    if isinstance(model, CountsPadding):  # its padding figures reach the stats
        model.count_padding(batcher.record_padding)
    return Executors(batcher, alone, s.batch_size * s.read_ahead)


def _length(prepared: Prepared) -> int:
    return prepared.length
