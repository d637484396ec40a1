"""Padded-tensor batching on asyncio: ``batchline.aio.inference.dynamically``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, overload

from batchline._decorators import make_aio_inference as _make
from batchline._inference import AioInferenceBatcher

__all__ = ["AioInferenceBatcher", "dynamically"]


@overload
def dynamically(fn: Callable[..., Any], /) -> AioInferenceBatcher: ...


@overload
def dynamically(
    fn: None = None,
    /,
    *,
    batch_size: int = ...,
    timeout_ms: float = ...,
    small_batch_threshold: int = ...,
    max_tokens: int | None = ...,
    max_queue_size: int | None = ...,
    isolate_errors: bool = ...,
    inline_below_ms: float = ...,
    pad_token: Mapping[str, Any] | float | None = ...,
    pad_tokens: Mapping[str, Any] | None = ...,
    padding_side: str = ...,
    spread_kwargs: bool = ...,
) -> Callable[[Callable[..., Any]], AioInferenceBatcher]: ...


def dynamically(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    batch_size: int = 32,
    timeout_ms: float = 5.0,
    small_batch_threshold: int = 8,
    max_tokens: int | None = None,
    max_queue_size: int | None = None,
    isolate_errors: bool = True,
    inline_below_ms: float = 0.2,
    pad_token: Mapping[str, Any] | float | None = None,
    pad_tokens: Mapping[str, Any] | None = None,
    padding_side: str = "right",
    spread_kwargs: bool = False,
) -> Any:
    """Batch an inference function over padded features on asyncio: ``await f(features)``.

    As :func:`batchline.inference.dynamically`; the function may be a coroutine function.

    Args:
        fn: the inference function (when used bare).
        batch_size: most rows per batch.
        timeout_ms: as for :func:`batchline.dynamically`.
        small_batch_threshold: as for :func:`batchline.dynamically`.
        max_tokens: padded-token budget of a batch: rows x longest row, a row's length being
            the first dimension of its first feature (the reference feature).
        max_queue_size: most rows waiting; past it a call raises QueueFull at once.
        isolate_errors: as for :func:`batchline.dynamically`.
        inline_below_ms: as for :func:`batchline.aio.dynamically`.
        pad_token: pad value per feature (``{"input_ids": 0}``), or one value for all;
            features not named pad with 0.
        pad_tokens: the same, under the name the ``batched`` library used.
        padding_side: "right" or "left".
        spread_kwargs: call the function as ``fn(**features)`` instead of ``fn(features)``.
    """
    return _make(
        fn,
        batch_size=batch_size,
        timeout_ms=timeout_ms,
        small_batch_threshold=small_batch_threshold,
        max_tokens=max_tokens,
        max_queue_size=max_queue_size,
        isolate_errors=isolate_errors,
        inline_below_ms=inline_below_ms,
        pad_token=pad_token,
        pad_tokens=pad_tokens,
        padding_side=padding_side,
        spread_kwargs=spread_kwargs,
    )
