"""asyncio-backed batching: ``batchline.aio.dynamically`` and ``batchline.aio.inference``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, Unpack, overload

from batchline.aio import inference
from batchline.drivers._aio import AioBatcher
from batchline.drivers._decorators import make_aio
from batchline.drivers._options import AioOptions

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
    fn: None = None, /, **options: Unpack[AioOptions]
) -> Callable[[Callable[..., Any]], AioBatcher[Any, Any]]: ...


def dynamically(fn: Callable[..., Any] | None = None, /, **options: Unpack[AioOptions]) -> Any:
    """Batch calls of ``fn`` dynamically on asyncio: ``await f(x)`` or ``await f([x1, x2])``.

    ``fn`` may be a coroutine function (awaited on the loop) or a plain one (run on a thread
    of the batcher's own, so the loop stays free).

    Args:
        fn: the batch function (when used bare).
        **options: those of :func:`batchline.dynamically`, and ``inline_below_ms``:
            :class:`batchline.AioOptions` says what each does and its default.
    """
    return make_aio(fn, options)
