"""The protocol a worker's model kinds follow (:class:`Model`), the item they prepare, and the
naming of a ``module:callable``."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["LOADING", "CountsPadding", "Model", "Prepared", "resolve_callable"]

#: Held while a model loads: one load at a time in a process, at start or by demand (the
#: imports of the model libraries are not thread-safe). Reentrant: a model loaded by demand
#: and told to load at start loads under the worker's hold.
LOADING = threading.RLock()


@dataclass(frozen=True, slots=True)
class Prepared:
    """One item ready for the model: its payload and its length in tokens."""

    payload: Any
    length: int = 1


@runtime_checkable
class Model(Protocol):
    """What a worker needs of a model.

    ``preprocess`` raises TypeError or ValueError for an input it cannot take: that request
    alone gets an error result. ``infer`` returns one output per item, or raises (the worker
    then isolates the failing items).
    """

    #: preprocess is worth a thread of its own (tokenizers); False runs it inline.
    heavy_preprocess: bool

    # Optional: ``pads = False`` tells the worker that batches are not padded, so grouping
    # requests of similar length is wasted work (a model without it is taken to pad).
    # Optional: ``preprocess_many(values)`` preprocesses one read's values at once, returning
    # per value its items or the exception that refuses it (the tokenizer models have it).
    # Optional: ``counts_tokens = True`` tells the worker that each item's ``length`` is its
    # tokenizer's count of tokens: their sum travels with the result (``tok``).
    # Optional: ``facts()``, what the worker publishes of the model (docs/protocol.md,
    # Model facts): ``kind``, ``dimensions``, ``max_model_len``, ``matryoshka``...
    # Optional: ``example``, an input (not None) of which the worker times one full batch at
    # start, before it reads anything: ``max_batch_ms`` auto then bounds even the first
    # batch by the model's own speed (the text models have one; a module:callable model
    # takes its function's ``example`` attribute).

    def load(self) -> None: ...

    def preprocess(self, value: Any) -> list[Prepared]: ...

    def infer(self, batch: list[Any]) -> Sequence[Any]: ...

    def postprocess(self, outputs: list[Any], value: Any) -> Any: ...


@runtime_checkable
class CountsPadding(Protocol):
    """A model that pads its batches itself (tensor models), and reports each batch's real
    and padded tokens to the worker's statistics (``padding_efficiency``)."""

    def count_padding(self, sink: Callable[[int, int], None]) -> None: ...


def resolve_callable(spec: str) -> Callable[..., Any]:
    """The callable that ``module:callable`` (``callable`` may be dotted) names."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"a callable is named 'module:callable', got {spec!r}")
    target: Any = importlib.import_module(module)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{spec} is not callable")
    return target  # type: ignore[no-any-return]
