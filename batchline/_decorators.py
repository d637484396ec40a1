"""The four ``dynamically`` decorators, built from one set of options."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from batchline._aio import AioBatcher
from batchline._base import BatchConfig, BatcherBase
from batchline._inference import AioInferenceBatcher, InferenceBatcher, Padding
from batchline._thread import ThreadBatcher
from batchline.core.padding import row_length

B = TypeVar("B", bound=BatcherBase[Any, Any])

__all__ = ["make_aio", "make_aio_inference", "make_inference", "make_thread"]


def _decorate(
    fn: Callable[..., Any] | None, make: Callable[[Callable[..., Any]], B]
) -> B | Callable[[Callable[..., Any]], B]:
    return make if fn is None else make(fn)


def make_thread(fn: Callable[..., Any] | None, **options: Any) -> Any:
    config = BatchConfig(**options)
    return _decorate(fn, lambda f: ThreadBatcher[Any, Any](f, config))


def make_aio(fn: Callable[..., Any] | None, **options: Any) -> Any:
    config = BatchConfig(**options)
    return _decorate(fn, lambda f: AioBatcher[Any, Any](f, config))


def _inference_parts(
    options: dict[str, Any],
    pad_token: Mapping[str, Any] | float | None,
    pad_tokens: Mapping[str, Any] | None,
    padding_side: str,
    spread_kwargs: bool,
) -> tuple[BatchConfig, Padding]:
    padding = Padding.of(pad_token, pad_tokens, padding_side, spread_kwargs)
    return BatchConfig(length_fn=row_length, **options), padding


def make_inference(
    fn: Callable[..., Any] | None,
    *,
    pad_token: Mapping[str, Any] | float | None,
    pad_tokens: Mapping[str, Any] | None,
    padding_side: str,
    spread_kwargs: bool,
    **options: Any,
) -> Any:
    config, padding = _inference_parts(options, pad_token, pad_tokens, padding_side, spread_kwargs)
    return _decorate(fn, lambda f: InferenceBatcher(f, config, padding=padding))


def make_aio_inference(
    fn: Callable[..., Any] | None,
    *,
    pad_token: Mapping[str, Any] | float | None,
    pad_tokens: Mapping[str, Any] | None,
    padding_side: str,
    spread_kwargs: bool,
    **options: Any,
) -> Any:
    config, padding = _inference_parts(options, pad_token, pad_tokens, padding_side, spread_kwargs)
    return _decorate(fn, lambda f: AioInferenceBatcher(f, config, padding=padding))
