"""One forward pass over the rows of a KV cache, with a failing row isolated.

:func:`run_rows` feeds new tokens to every row of a transformers ``DynamicCache``. When the
model raises, the step is retried without the row that raised, by the batcher's own rule
(:class:`~batchline.core.isolation.Isolation`: split in halves down to single rows, each
retried once): rows whose forward succeeds keep their outputs, a row that raises alone fails
alone. A failure no row causes alone (the whole raises, the halves do not) fails nobody; one
that every subset raises fails every row, each alone. At most ``2 n - 1`` forward passes for
``n`` rows: never a loop.

Before the retries the cache is rewound to its state before the failed pass. That needs no
copy: ``DynamicLayer.update`` (transformers 5) grows a layer with ``torch.cat``, a new tensor
holding the old columns unchanged and the new ones after them, so the state before is every
layer cut back to its old length (a view), and any layer the pass created dropped. The
normal path therefore keeps no snapshot at all (holding the old tensors would double the
cache's memory during each step). The retries run on copies of the rows they feed; the
survivors' rows are then stacked into a new cache. Failures are rare: that path may copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from batchline.core.isolation import Isolation
from batchline.generation._lora import rows_adapters

__all__ = ["Ran", "cache_of", "rewind", "run_rows"]

logger = logging.getLogger(__name__)

#: (input ids [rows, k], attention mask [rows, past + k], position ids [rows, k], cache) ->
#: the logits of each row's last position [rows, vocab]; grows the cache by k columns.
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]


@dataclass(slots=True)
class Ran:
    """What :func:`run_rows` did.

    Attributes:
        logits: the last position's logits of each row kept, in row order (None if none is).
        cache: the cache after the pass, holding the rows kept (the same object when no row
            failed; None when every row did).
        kept: the indexes of the rows that went through, in order.
        failed: (row index, what its forward raised alone) for each row that failed.
    """

    logits: torch.Tensor | None
    cache: Any
    kept: list[int]
    failed: list[tuple[int, Exception]] = field(default_factory=list)


@dataclass(slots=True)
class _Row:
    """One row as :class:`Isolation` settles it (its ``Settleable``)."""

    payload: int
    output: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
    error: Exception | None = None

    @property
    def cancelled(self) -> bool:
        return False

    def resolve(self, value: Any) -> None:
        self.output = value

    def reject(self, exc: BaseException) -> None:
        # Isolation hands back what the forward raised; only Exceptions are caught here.
        self.error = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))


def run_rows(
    forward: Forward,
    cache: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    pos: torch.Tensor,
    *,
    adapters: torch.Tensor | None = None,
) -> Ran:
    """Feed ``ids`` to every row of ``cache``; isolate a row whose forward raises.
    ``adapters``: each row's LoRA adapter index (-1: none), or None for no adapter at all."""
    layers, width = len(cache.layers), mask.shape[1] - ids.shape[1]
    try:
        with rows_adapters(adapters):
            logits = forward(ids, mask, pos, cache)
        return Ran(logits, cache, list(range(ids.shape[0])))
    except Exception as exc:
        first = exc
    rewind(cache, layers, width)
    rows = [_Row(i) for i in range(ids.shape[0])]
    if len(rows) > 1:
        logger.warning(
            "a generation step over %d sequences raised %s: %s; retrying it without the one "
            "that raised",
            len(rows),
            type(first).__name__,
            first,
        )
    isolation = Isolation(rows)
    isolation.next()  # the whole batch, which has just failed: split it
    isolation.failed(first)
    while (batch := isolation.next()) is not None:
        index = torch.tensor(batch, device=ids.device)
        sub = cache_of([(layer.keys[index], layer.values[index]) for layer in cache.layers])
        try:
            with rows_adapters(None if adapters is None else adapters[index.cpu()]):
                logits = forward(ids[index], mask[index], pos[index], sub)
        except Exception as exc:
            isolation.failed(exc)
            continue
        kv = sub.layers
        isolation.succeeded(
            [(logits[j], [(lay.keys[j], lay.values[j]) for lay in kv]) for j in range(len(batch))]
        )
    kept = [row for row in rows if row.output is not None]
    failed = [(row.payload, row.error) for row in rows if row.error is not None]
    if not kept:
        return Ran(None, None, [], failed)
    outputs = [row.output for row in kept if row.output is not None]
    stacked = [
        (torch.stack([o[1][i][0] for o in outputs]), torch.stack([o[1][i][1] for o in outputs]))
        for i in range(len(outputs[0][1]))
    ]
    logits = torch.stack([o[0] for o in outputs])
    return Ran(logits, cache_of(stacked), [row.payload for row in kept], failed)


def rewind(cache: Any, layers: int, width: int) -> None:
    """Put ``cache`` back as it was before a pass that found it with ``layers`` layers of
    ``width`` columns (see the module docstring: passes only append columns)."""
    del cache.layers[layers:]
    for layer in cache.layers:
        if layer.keys.shape[-2] > width:
            layer.keys = layer.keys[..., :width, :]
        if layer.values.shape[-2] > width:
            layer.values = layer.values[..., :width, :]


def cache_of(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A ``DynamicCache`` holding these (keys, values) of each layer, not copied."""
    from transformers import DynamicCache

    cache: Any = DynamicCache()
    for i, (keys, values) in enumerate(layers):
        cache.update(keys[..., :0, :], values[..., :0, :], i)  # creates the layer, empty
        cache.layers[i].keys, cache.layers[i].values = keys, values
    return cache
