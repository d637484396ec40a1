"""The four ``dynamically`` decorators, built from one set of options (:mod:`._options`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from batchline.core.padding import row_length
from batchline.drivers._aio import AioBatcher
from batchline.drivers._base import BatchConfig, BatcherBase
from batchline.drivers._inference import AioInferenceBatcher, InferenceBatcher, Padding
from batchline.drivers._options import (
    AioInferenceOptions,
    AioOptions,
    InferenceOptions,
    PaddingOptions,
    ThreadOptions,
)
from batchline.drivers._threads import ThreadBatcher

B = TypeVar("B", bound=BatcherBase[Any, Any])

__all__ = ["make_aio", "make_aio_inference", "make_inference", "make_thread"]

_PADDING_KEYS = frozenset(PaddingOptions.__annotations__)


def _decorate(
    fn: Callable[..., Any] | None, make: Callable[[Callable[..., Any]], B]
) -> B | Callable[[Callable[..., Any]], B]:
    return make if fn is None else make(fn)


def make_thread(fn: Callable[..., Any] | None, options: ThreadOptions) -> Any:
    config = BatchConfig(**options)
    return _decorate(fn, lambda f: ThreadBatcher[Any, Any](f, config))


def make_aio(fn: Callable[..., Any] | None, options: AioOptions) -> Any:
    config = BatchConfig(**options)
    return _decorate(fn, lambda f: AioBatcher[Any, Any](f, config))


def _inference_parts(
    options: InferenceOptions | AioInferenceOptions,
) -> tuple[BatchConfig, Padding]:
    given: dict[str, Any] = dict(options)
    padding = Padding.of(**{k: given.pop(k) for k in _PADDING_KEYS if k in given})
    if "length_fn" in given:
        raise TypeError("the inference decorators measure rows themselves: no length_fn")
    return BatchConfig(length_fn=row_length, **given), padding


def make_inference(fn: Callable[..., Any] | None, options: InferenceOptions) -> Any:
    config, padding = _inference_parts(options)
    return _decorate(fn, lambda f: InferenceBatcher(f, config, padding=padding))


def make_aio_inference(fn: Callable[..., Any] | None, options: AioInferenceOptions) -> Any:
    config, padding = _inference_parts(options)
    return _decorate(fn, lambda f: AioInferenceBatcher(f, config, padding=padding))
