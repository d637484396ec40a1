"""Deterministic mode: a torch model whose every row is computed by arithmetic that does not
depend on the batch around it, so that one input's output is the same bits alone and in
any batch (any batch-mates, any number of them, any padding). torch is imported only when
a model is made deterministic.

Which kernels vary with the batch was measured (``python -m benchmarks.invariance``, figures
in docs/benchmarks.md): on a CPU, a ``Linear``'s GEMM rounds a row differently with the
number of rows M (float32: one row, two or three, four and more take different kernels),
and attention over a padded batch rounds differently with the padded length (its key blocks
change); norms, softmax over a row, GELU and masked mean pooling did not vary. So
:func:`make_deterministic` changes those two, in place:

- every ``torch.nn.Linear`` computes its rows padded with zero rows to a multiple of a
  tile (:func:`tiled_linear`), so that its GEMM never takes the paths that round a row
  differently. The tile is probed for each weight's shape and dtype when the model is made
  deterministic (:func:`row_tile`): the smallest of :data:`TILES` at which one row gives
  the same bits among every number of rows tried; :data:`ROW_TILE` where none smaller
  does. On the project's CPU that is 4 in both dtypes;
- every attention of a transformers model goes through :func:`per_sequence_attention`
  (registered with its ``AttentionInterface``). An encoder's (full attention) is computed
  one sequence at a time over its own tokens only, the padding cut out: the call each
  sequence gets alone.
- A causal LM's attention is computed in units whose arithmetic does not depend on the
  others (:func:`._attention._blocked`): a unit is a sequence's decoding query, or a tile of
  :data:`ROW_TILE` positions of its prompt (position ``p`` in the tile ``p //
  ROW_TILE``, whichever chunk fed it). A unit's keys are its sequence's, gathered from the
  first (the padding, and the gap after a cached prefix, cut out) in blocks of
  :data:`ROW_TILE` keys; each block's scores and weighted values are GEMMs of one shape;
  the softmax runs over all the blocks' scores, those past a unit's keys masked (the
  batch's longest sets their number: the same result whatever it is, measured), and the
  blocks' weighted values are added in their order, so the masked blocks add zeros. So a
  prompt's query gets the same bits fed whole, in chunks, or after the prefix cache, and
  a decoding step the same alone or among any rows. (A generation engine marks its
  prompt passes with :func:`prompt_pass`: a chunk of one token is a prompt's, not a
  decoding step's.) As transformers' eager attention, scores and weighted sums are
  computed in the model's dtype, the softmax in float32.

What is promised is the same bits on one machine, one torch and one thread count, whatever
the batch; not the same bits as the mode off, nor across CPUs or torch versions.
"""

from __future__ import annotations

import functools
from typing import Any

from batchline.deterministic._attention import ATTENTION, per_sequence_attention, prompt_pass
from batchline.deterministic._linear import (
    ROW_TILE,
    TILES,
    conv1d_forward,
    linear_forward,
    row_tile,
    tiled_linear,
)

__all__ = [
    "ATTENTION",
    "ROW_TILE",
    "TILES",
    "make_deterministic",
    "per_sequence_attention",
    "prompt_pass",
    "row_tile",
    "tiled_linear",
]


@functools.cache
def _register() -> None:
    """:func:`per_sequence_attention` registered with transformers as :data:`ATTENTION`,
    its masks made as ``sdpa``'s are."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, per_sequence_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def make_deterministic(model: Any) -> Any:
    """``model`` (a torch module) changed in place to deterministic mode and returned: its
    ``Linear`` layers (and transformers' ``Conv1D``, GPT-2's) compute through
    :func:`tiled_linear`, and each transformers model in
    it attends through :func:`per_sequence_attention`.

    ValueError if it holds a transformers model whose attention does not go through
    transformers' ``AttentionInterface`` (its batch-invariance could not be held).
    """
    import torch

    models = [sub for sub in model.modules() if _is_transformers_model(sub)]
    for sub in models:
        if not getattr(sub, "_supports_attention_backend", False):
            raise ValueError(
                f"deterministic mode needs a model whose attention goes through transformers' "
                f"AttentionInterface; {type(sub).__name__} has its own"
            )
    conv1d = _conv1d_type()
    for sub in model.modules():
        if isinstance(sub, torch.nn.Linear):
            tile = row_tile(sub.weight, sub.bias)
            sub.forward = functools.partial(linear_forward, sub, tile)  # type: ignore[method-assign]
        elif conv1d is not None and isinstance(sub, conv1d):
            tile = row_tile(sub.weight.t(), sub.bias)
            sub.forward = functools.partial(conv1d_forward, sub, tile)
    if models:
        _register()
    for sub in models:
        sub.config._attn_implementation = ATTENTION
    return model


def _conv1d_type() -> Any:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers ships with the torch extras
        return None
    return Conv1D


def _is_transformers_model(module: Any) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers ships with the torch extras
        return False
    return isinstance(module, PreTrainedModel)
