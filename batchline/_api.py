"""``batchline.dynamically``: the thread-backed decorator."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

from batchline._decorators import make_thread
from batchline._thread import ThreadBatcher

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["dynamically"]


@overload
def dynamically(fn: Callable[[list[T]], Sequence[R]], /) -> ThreadBatcher[T, R]: ...


@overload
def dynamically(fn: Callable[..., Any], /) -> ThreadBatcher[Any, Any]: ...


@overload
def dynamically(
    fn: None = None,
    /,
    *,
    batch_size: int = ...,
    timeout_ms: float = ...,
    small_batch_threshold: int = ...,
    max_tokens: int | None = ...,
    length_fn: Callable[[Any], int] | None = ...,
    max_queue_size: int | None = ...,
    isolate_errors: bool = ...,
) -> Callable[[Callable[..., Any]], ThreadBatcher[Any, Any]]: ...


def dynamically(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    batch_size: int = 32,
    timeout_ms: float = 5.0,
    small_batch_threshold: int = 8,
    max_tokens: int | None = None,
    length_fn: Callable[[Any], int] | None = None,
    max_queue_size: int | None = None,
    isolate_errors: bool = True,
) -> Any:
    """Batch calls of ``fn`` dynamically on a worker thread.

    ``fn`` takes a list of inputs and returns a sequence of as many results. Use it bare
    (``@dynamically``) or with arguments, on functions or on methods (one batcher per
    instance, freed with it). ``f(x)`` returns one result and ``f([x1, x2])`` a list;
    ``await f.acall(...)`` does the same from asyncio. Every call also takes ``timeout_s=``
    or ``deadline=`` (a ``time.monotonic()`` time).

    Args:
        fn: the batch function (when used bare).
        batch_size: most items per batch.
        timeout_ms: longest the oldest waiting item waits for its batch to fill; 0 runs
            whatever waits as soon as the function is free (batches still grow under load).
        small_batch_threshold: calls of at most this many items go before larger calls,
            overtaking them by at most 100 ms, so that larger calls never starve.
        max_tokens: padded-token budget of one batch (rows x longest row); needs ``length_fn``.
        length_fn: an item's length in tokens; when given, similar lengths are also grouped
            into one batch whenever more items wait than fit.
        max_queue_size: most items waiting; past it a call raises QueueFull at once.
        isolate_errors: when the function raises, split the batch and retry the halves, so
            that only the failing items' callers get the exception.

    Returns:
        A :class:`ThreadBatcher`, or a decorator that makes one.
    """
    return make_thread(
        fn,
        batch_size=batch_size,
        timeout_ms=timeout_ms,
        small_batch_threshold=small_batch_threshold,
        max_tokens=max_tokens,
        length_fn=length_fn,
        max_queue_size=max_queue_size,
        isolate_errors=isolate_errors,
    )
