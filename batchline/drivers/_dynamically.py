"""``batchline.dynamically``: the thread-backed decorator."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, Unpack, overload

from batchline.drivers._decorators import make_thread
from batchline.drivers._options import ThreadOptions
from batchline.drivers._threads import ThreadBatcher

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["dynamically"]


@overload
def dynamically(fn: Callable[[list[T]], Sequence[R]], /) -> ThreadBatcher[T, R]: ...


@overload
def dynamically(fn: Callable[..., Any], /) -> ThreadBatcher[Any, Any]: ...


@overload
def dynamically(
    fn: None = None, /, **options: Unpack[ThreadOptions]
) -> Callable[[Callable[..., Any]], ThreadBatcher[Any, Any]]: ...


def dynamically(fn: Callable[..., Any] | None = None, /, **options: Unpack[ThreadOptions]) -> Any:
    """Batch calls of ``fn`` dynamically on a worker thread.

    ``fn`` takes a list of inputs and returns a sequence of as many results. Use it bare
    (``@dynamically``) or with options, on functions or on methods (one batcher per
    instance, freed with it). ``f(x)`` returns one result and ``f([x1, x2])`` a list;
    ``await f.acall(...)`` does the same from asyncio. Every call also takes ``timeout_s=``
    or ``deadline=`` (a ``time.monotonic()`` time).

    Args:
        fn: the batch function (when used bare).
        **options: ``batch_size``, ``timeout_ms``, ``small_batch_threshold``, ``max_tokens``,
            ``length_fn``, ``max_queue_size``, ``isolate_errors``, ``target_p99_ms``:
            :class:`batchline.ThreadOptions` says what each does and its default.

    Returns:
        A :class:`ThreadBatcher`, or a decorator that makes one.
    """
    return make_thread(fn, options)
