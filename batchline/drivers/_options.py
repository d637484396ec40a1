"""The options of the ``dynamically`` decorators, declared once.

Each decorator takes ``**options: Unpack[...]`` of one of the TypedDicts below, so mypy checks
every option a caller passes, and adding an option is one line here, one field of
:class:`~batchline.drivers._base.BatchConfig` (its default and validation) or of
:class:`~batchline.drivers._inference.Padding`, and one line of documentation. The defaults live in
those two classes only; :data:`DEFAULTS` exposes them to the worker settings and the docs.

Options of every decorator (:class:`BatchOptions`):

- ``batch_size``: most items (rows, for the inference decorators) per batch. Default 32.
- ``timeout_ms``: longest the oldest waiting item waits for its batch to fill; 0 runs
  whatever waits as soon as the function is free (batches still grow under load). Default 5.
- ``small_batch_threshold``: calls of at most this many items go before larger calls,
  overtaking them by at most 100 ms, so that larger calls never starve. Default 8.
- ``max_tokens``: padded-token budget of one batch (rows x longest row). The plain
  decorators need ``length_fn`` for it; the inference decorators measure a row by the first
  dimension of its first feature. Default: no budget.
- ``max_queue_size``: most items waiting; past it a call raises QueueFull at once. Default:
  no bound.
- ``isolate_errors``: when the function raises, split the batch and retry the halves, so
  that only the failing items' callers get the exception. Default True.
- ``target_p99_ms``: latency-SLO mode. The batcher chooses its batch size (up to
  ``batch_size``) and wait (up to ``timeout_ms``) online, from the batch function's measured
  time per batch size and the load, to keep the p99 of queue wait plus function time at or
  under this target while serving the most it can (:mod:`batchline.core.slo`); when the load
  exceeds what any setting can serve within the target, it runs without a wait at the
  smallest batch size that keeps up with the load (up to ``batch_size``). ``stats`` shows
  the chosen settings. Default: off (fixed settings).

Plain decorators (:class:`ThreadOptions`) add ``length_fn``: an item's length in tokens, a
number >= 0 (a fraction counts as the next whole number; anything else is the call's
TypeError or ValueError, before it is queued); when given, similar lengths are also grouped
into one batch whenever more items wait than fit. The asyncio decorators add
``inline_below_ms`` (default 0.2): a plain function whose last 16 calls each returned within
this many milliseconds runs on the event loop itself, where it costs less than the round
trip to its thread; one slower call sends it back to the thread; 0 keeps it on its thread
always.

The inference decorators add :class:`PaddingOptions`:

- ``pad_token``: pad value per feature (``{"input_ids": 0}``), or one value for all;
  features not named pad with 0.
- ``pad_tokens``: the same, under the name the ``batched`` library used.
- ``padding_side``: ``"right"`` (default) or ``"left"``.
- ``spread_kwargs``: call the function as ``fn(**features)`` instead of ``fn(features)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, TypedDict

from batchline.drivers._base import BatchConfig

__all__ = [
    "DEFAULTS",
    "AioInferenceOptions",
    "AioOptions",
    "BatchOptions",
    "InferenceOptions",
    "PaddingOptions",
    "ThreadOptions",
]

#: A batcher's settings when no option is given (the defaults quoted above).
DEFAULTS = BatchConfig()


class BatchOptions(TypedDict, total=False):
    """Options every ``dynamically`` decorator takes (see the module's docstring)."""

    batch_size: int
    timeout_ms: float
    small_batch_threshold: int
    max_tokens: int | None
    max_queue_size: int | None
    isolate_errors: bool
    target_p99_ms: float | None


class ThreadOptions(BatchOptions, total=False):
    """``batchline.dynamically``'s options."""

    length_fn: Callable[[Any], int] | None


class AioOptions(ThreadOptions, total=False):
    """``batchline.aio.dynamically``'s options."""

    inline_below_ms: float


class PaddingOptions(TypedDict, total=False):
    """How the inference decorators pad rows and call their function."""

    pad_token: Mapping[str, Any] | float | None
    pad_tokens: Mapping[str, Any] | None
    padding_side: Literal["left", "right"]
    spread_kwargs: bool


class InferenceOptions(BatchOptions, PaddingOptions, total=False):
    """``batchline.inference.dynamically``'s options."""


class AioInferenceOptions(InferenceOptions, total=False):
    """``batchline.aio.inference.dynamically``'s options."""

    inline_below_ms: float
