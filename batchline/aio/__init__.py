"""asyncio-backed batching: ``batchline.aio.dynamically`` and ``batchline.aio.inference``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, overload

from batchline._aio import AioBatcher
from batchline._decorators import make_aio as _make
from batchline.aio import inference

_T = TypeVar("_T")
_R = TypeVar("_R")

__all__ = ["AioBatcher", "dynamically", "inference"]


@overload
def dynamically(fn: Callable[[list[_T]], Awaitable[Sequence[_R]]], /) -> AioBatcher[_T, _R]: ...


@overload
def dynamically(fn: Callable[[list[_T]], Sequence[_R]], /) -> AioBatcher[_T, _R]: ...


@overload
def dynamically(fn: Callable[..., Any], /) -> AioBatcher[Any, Any]: ...


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
    inline_below_ms: float = ...,
) -> Callable[[Callable[..., Any]], AioBatcher[Any, Any]]: ...


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
    inline_below_ms: float = 0.2,
) -> Any:
    """Batch calls of ``fn`` dynamically on asyncio: ``await f(x)`` or ``await f([x1, x2])``.

    ``fn`` may be a coroutine function (awaited on the loop) or a plain one (run on a thread
    of the batcher's own, so the loop stays free). The arguments are those of
    :func:`batchline.dynamically`, and:

    Args:
        inline_below_ms: a plain function whose last 16 calls each returned within this many
            milliseconds runs on the event loop itself, where it costs less than the round
            trip to its thread; one slower call sends it back to the thread. 0: always on
            its thread (for a function that must keep to one thread).
    """
    return _make(
        fn,
        batch_size=batch_size,
        timeout_ms=timeout_ms,
        small_batch_threshold=small_batch_threshold,
        max_tokens=max_tokens,
        length_fn=length_fn,
        max_queue_size=max_queue_size,
        isolate_errors=isolate_errors,
        inline_below_ms=inline_below_ms,
    )
