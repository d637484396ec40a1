"""The ``module:callable`` model kind: any batch function, a list of inputs in, as many
outputs out; and :func:`echo`, the no-op one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from batchline.worker.models._protocol import Prepared, resolve_callable

__all__ = ["CallableModel", "echo"]


def echo(items: list[Any]) -> list[Any]:
    """A batch function that returns its inputs (the no-op model)."""
    return items


class CallableModel:
    """Any batch function, named ``module:callable``: a list of inputs in, as many outputs out.

    Each request's input is one item, passed as it came (JSON values, arrays, texts). Its
    length (characters of a text, entries of a list, else 1) counts toward ``max_tokens``;
    the worker does not group lengths for it (the function pads, if at all, on its own).
    """

    heavy_preprocess = False
    pads = False

    def __init__(self, spec: str) -> None:
        module, sep, attr = spec.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"a callable model is 'module:callable', got {spec!r}")
        self.spec = spec
        self.fn: Callable[[list[Any]], Sequence[Any]] | None = None

    def load(self) -> None:
        self.fn = resolve_callable(self.spec)

    def preprocess(self, value: Any) -> list[Prepared]:
        return [Prepared(value, len(value) if isinstance(value, str | list) else 1)]

    @property
    def example(self) -> Any:
        """The function's ``example`` attribute, if it has one: an input of which the worker
        times a full batch at start (None: no warm-up batch)."""
        return getattr(self.fn, "example", None)

    def infer(self, batch: list[Any]) -> Sequence[Any]:
        if self.fn is None:
            raise RuntimeError("the model is not loaded")
        return self.fn(batch)

    def postprocess(self, outputs: list[Any], value: Any) -> Any:
        return outputs[0]
