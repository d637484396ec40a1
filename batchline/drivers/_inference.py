"""Padded-tensor batchers: the thread and asyncio drivers with padding around the function.

A call passes features (a dict of arrays or tensors, batch first); its rows become the items
the core batches, their length (the reference feature's first dimension) drives the token
budget and length grouping, and each batch is collated, run and split back by
:mod:`batchline.core.padding`. The caller gets its own rows back, stacked.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from batchline.core.padding import Side, collate, split_outputs, split_rows, stack_rows
from batchline.core.stats import StatsRecorder
from batchline.drivers._aio import AioBatcher
from batchline.drivers._base import BatchConfig, BatcherBase
from batchline.drivers._threads import ThreadBatcher

__all__ = ["AioInferenceBatcher", "InferenceBatcher", "Padding"]

P = TypeVar("P", bound="_Padded")


@dataclass(frozen=True, slots=True)
class Padding:
    """How an inference batcher pads and calls its function."""

    pad_tokens: Mapping[str, Any] = field(default_factory=dict)
    side: Side = "right"
    spread_kwargs: bool = False
    default_pad: Any = 0

    @classmethod
    def of(
        cls,
        *,
        pad_token: Mapping[str, Any] | float | None = None,
        pad_tokens: Mapping[str, Any] | None = None,
        padding_side: Side | None = None,
        spread_kwargs: bool | None = None,
    ) -> Padding:
        """From the decorators' :class:`~batchline.drivers._options.PaddingOptions`: ``pad_token``
        (or batched's ``pad_tokens``) is a dict of feature -> pad value, or one value for
        every feature; what is not given keeps this class's default."""
        if pad_token is not None and pad_tokens is not None:
            raise TypeError("pass pad_token or pad_tokens, not both")
        given = pad_token if pad_token is not None else pad_tokens
        how: dict[str, Any] = {}
        if padding_side is not None:
            how["side"] = padding_side
        if spread_kwargs is not None:
            how["spread_kwargs"] = spread_kwargs
        if given is None:
            return cls(**how)
        if isinstance(given, Mapping):
            return cls(pad_tokens=dict(given), **how)
        return cls(default_pad=given, **how)

    def __post_init__(self) -> None:
        if self.side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {self.side!r}")
        if not isinstance(self.pad_tokens, Mapping):
            raise TypeError(
                f"pad_token must be a dict of feature -> value, got {self.pad_tokens!r}"
            )

    @staticmethod
    def rows(features: Mapping[str, Any] | None, named: Mapping[str, Any]) -> list[Any]:
        if features is not None and named:
            raise TypeError("pass features as one dict or as keyword arguments, not both")
        return split_rows(features if features is not None else named)

    def run(self, apply: Callable[..., Any], rows: list[Any], recorder: StatsRecorder) -> Any:
        """Collate ``rows``, call the function through ``apply``, split its outputs per row."""
        batch, info = collate(rows, self.pad_tokens, self.side, self.default_pad)
        recorder.record_padding(info.real, info.total)
        outputs = apply(**batch) if self.spread_kwargs else apply(batch)
        if inspect.isawaitable(outputs):
            return _split_later(outputs, info)
        return split_outputs(outputs, info)


async def _split_later(outputs: Awaitable[Any], info: Any) -> list[Any]:
    return split_outputs(await outputs, info)


class _Padded(BatcherBase[Any, Any]):
    """Padding around the batch function; comes before the driver in the MRO."""

    def __init__(
        self,
        fn: Callable[..., Any],
        config: BatchConfig,
        *,
        owner: weakref.ref[Any] | None = None,
        padding: Padding | None = None,
    ) -> None:
        super().__init__(fn, config, owner=owner)
        self._padding = padding or Padding()

    def _rebind(self: P, owner: weakref.ref[Any]) -> P:
        return type(self)(self._fn, self._config, owner=owner, padding=self._padding)

    def _invoke(self, payloads: list[Any]) -> Any:
        return self._padding.run(self._apply, payloads, self._recorder)


class InferenceBatcher(_Padded, ThreadBatcher[Any, Any]):
    """``batchline.inference.dynamically``: padded features batched on a worker thread.

    ``f(features)`` or ``f(**features)`` returns the function's outputs for the call's own
    rows; ``await f.acall(features)`` likewise without blocking the event loop.
    """

    def __call__(  # type: ignore[override]
        self,
        features: Mapping[str, Any] | None = None,
        /,
        *,
        timeout_s: float | None = None,
        deadline: float | None = None,
        **named: Any,
    ) -> Any:
        """Run the call's rows through the batcher; returns its outputs, stacked."""
        rows = self._padding.rows(features, named)
        return stack_rows(super().__call__(rows, timeout_s=timeout_s, deadline=deadline))

    async def acall(  # type: ignore[override]
        self,
        features: Mapping[str, Any] | None = None,
        /,
        *,
        timeout_s: float | None = None,
        deadline: float | None = None,
        **named: Any,
    ) -> Any:
        """Like calling the batcher, but awaited."""
        rows = self._padding.rows(features, named)
        return stack_rows(await super().acall(rows, timeout_s=timeout_s, deadline=deadline))


class AioInferenceBatcher(_Padded, AioBatcher[Any, Any]):
    """``batchline.aio.inference.dynamically``: padded features batched on asyncio."""

    async def __call__(  # type: ignore[override]
        self,
        features: Mapping[str, Any] | None = None,
        /,
        *,
        timeout_s: float | None = None,
        deadline: float | None = None,
        **named: Any,
    ) -> Any:
        """Run the call's rows through the batcher; returns its outputs, stacked."""
        rows = self._padding.rows(features, named)
        return stack_rows(await super().__call__(rows, timeout_s=timeout_s, deadline=deadline))
