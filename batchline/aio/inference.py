"""Padded-tensor batching on asyncio: ``batchline.aio.inference.dynamically``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Unpack, overload

from batchline.drivers._decorators import make_aio_inference
from batchline.drivers._inference import AioInferenceBatcher
from batchline.drivers._options import AioInferenceOptions

__all__ = ["AioInferenceBatcher", "dynamically"]


@overload
def dynamically(fn: Callable[..., Any], /) -> AioInferenceBatcher: ...


@overload
def dynamically(
    fn: None = None, /, **options: Unpack[AioInferenceOptions]
) -> Callable[[Callable[..., Any]], AioInferenceBatcher]: ...


def dynamically(
    fn: Callable[..., Any] | None = None, /, **options: Unpack[AioInferenceOptions]
) -> Any:
    """Batch an inference function over padded features on asyncio: ``await f(features)``.

    As :func:`batchline.inference.dynamically`; the function may be a coroutine function.

    Args:
        fn: the inference function (when used bare).
        **options: those of :func:`batchline.inference.dynamically`, and
            ``inline_below_ms``: :class:`batchline.AioInferenceOptions` says what each does
            and its default.
    """
    return make_aio_inference(fn, options)
