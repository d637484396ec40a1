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

- every ``torch.nn.Linear`` computes its rows padded with zero rows to a multiple of
  :data:`ROW_TILE` (:func:`tiled_linear`): the GEMM never takes its small-M paths, and a
  row's result is the same whichever multiple of the tile the batch makes (measured, and
  held by the tests);
- every attention of a transformers model (through its ``AttentionInterface``) is computed
  one sequence at a time over its own tokens only, the padding cut out
  (:func:`per_sequence_attention`): each sequence's attention has the shape it has alone.

What is promised is the same bits on one machine, one torch and one thread count, whatever
the batch; not the same bits as the mode off, nor across CPUs or torch versions.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["ATTENTION", "ROW_TILE", "make_deterministic", "per_sequence_attention", "tiled_linear"]

#: Rows of a ``Linear``'s input are padded with zeros to a multiple of this in
#: deterministic mode.
ROW_TILE = 64

#: The name of :func:`per_sequence_attention` among transformers' attention functions.
ATTENTION = "batchline_deterministic"


def tiled_linear(x: Any, weight: Any, bias: Any = None) -> Any:
    """``torch.nn.functional.linear(x, weight, bias)`` in one GEMM over a multiple of
    :data:`ROW_TILE` rows: the rows of ``x`` (all its dimensions but the last, flattened),
    copied with zero rows after them where their number is not one already. (A tile of its
    own for the rows left over costs more: a GEMM of 64 rows took 40 % of the time of one
    of 1,312 in bfloat16.)"""
    import torch

    width = x.shape[-1]
    flat = x.reshape(-1, width)
    rows = flat.shape[0]
    padded = -(-rows // ROW_TILE) * ROW_TILE
    if padded != rows:
        buffer = flat.new_empty((padded, width))
        buffer[:rows] = flat
        buffer[rows:] = 0
        flat = buffer
    else:
        flat = flat.contiguous()
    out = torch.nn.functional.linear(flat, weight, bias)
    return out[:rows].reshape(*x.shape[:-1], weight.shape[0])


def _linear_forward(module: Any, x: Any) -> Any:
    return tiled_linear(x, module.weight, module.bias)


def _conv1d_forward(module: Any, x: Any) -> Any:
    """transformers' ``Conv1D`` (GPT-2's linears: ``x @ weight + bias``) through
    :func:`tiled_linear`."""
    return tiled_linear(x, module.weight.t(), module.bias)


def per_sequence_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **_kwargs: Any,
) -> tuple[Any, None]:
    """A transformers attention function (as ``sdpa`` is one): each sequence of the batch
    attended over its own tokens only, as it is alone.

    A sequence's tokens are the keys some query may attend to; its queries are the last
    ``query`` positions of them (self-attention, a cache before them). Its queries, keys,
    values and mask are gathered without the padding, and
    ``scaled_dot_product_attention`` runs on them with its mask, or None where that masks
    nothing, one call a sequence: the call it gets alone. Padded queries' outputs are
    zeros. The mask may be boolean (True: attend) or additive; None is full attention, or
    causal where the module (or ``is_causal``) says so.
    """
    import torch

    if dropout:
        raise ValueError(f"deterministic attention is for inference, got dropout {dropout}")
    repeats = getattr(module, "num_key_value_groups", 1)
    if repeats > 1:
        key = key.repeat_interleave(repeats, dim=1)
        value = value.repeat_interleave(repeats, dim=1)
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    allowed = _allowed(
        module,
        attention_mask,
        is_causal=is_causal,
        query=query,
        batch=batch,
        q_len=q_len,
        k_len=k_len,
    )
    additive = attention_mask is not None and attention_mask.dtype != torch.bool
    if additive:
        attention_mask = attention_mask.expand(batch, 1, q_len, k_len)
    out = query.new_zeros((batch, q_len, heads, value.shape[-1]))
    patterns, which = torch.unique(allowed.any(dim=1), dim=0, return_inverse=True)
    for index, pattern in enumerate(patterns):
        tokens = pattern.nonzero().squeeze(1)
        mine = tokens[tokens >= k_len - q_len] - (k_len - q_len)
        if mine.numel() == 0:
            continue
        rows = (which == index).nonzero().squeeze(1)
        if additive:
            masks = _cut(attention_mask, rows, mine, tokens)
            unmasked = (masks == 0).flatten(1).all(dim=1)
        else:
            masks = _cut(allowed.unsqueeze(1), rows, mine, tokens)
            unmasked = masks.flatten(1).all(dim=1)
        for row, full, mask in zip(rows.tolist(), unmasked.tolist(), masks, strict=True):
            # One call a row: a call over several rows rounded differently from one over
            # a row alone at some shapes (float32, heads of 8: batch 1 against 2 and more).
            one = rows.new_tensor([row])
            result = torch.nn.functional.scaled_dot_product_attention(
                _cut(query, one, mine),
                _cut(key, one, tokens),
                _cut(value, one, tokens),
                attn_mask=None if full else mask.unsqueeze(0),
                scale=scaling,
            )
            out[row, mine] = result[0].transpose(0, 1)
    return out, None


def _cut(t: Any, rows: Any, first: Any, second: Any = None) -> Any:
    """``t``'s batch ``rows``, positions ``first`` on dim 2 (and ``second`` on dim 3), in a
    tensor of their own: the same layout whichever rows and batch they come from."""
    t = t.index_select(0, rows).index_select(2, first)
    return t if second is None else t.index_select(3, second)


def _allowed(
    module: Any,
    mask: Any,
    *,
    is_causal: bool | None,
    query: Any,
    batch: int,
    q_len: int,
    k_len: int,
) -> Any:
    """Which keys each query may attend to, (batch, q_len, k_len) booleans, from the mask
    (its heads must agree: one per batch row) or, without one, full or causal attention."""
    import torch

    if mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        if causal and q_len > 1:
            offset = k_len - q_len
            q = torch.arange(q_len, device=query.device)[:, None]
            k = torch.arange(k_len, device=query.device)[None, :]
            full = k <= q + offset
        else:
            full = torch.ones((q_len, k_len), dtype=torch.bool, device=query.device)
        return full.expand(batch, q_len, k_len)
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(
            f"deterministic attention takes a mask of shape (batch, 1, queries, keys), "
            f"got {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask[:, 0].expand(batch, q_len, k_len)


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
            sub.forward = functools.partial(_linear_forward, sub)  # type: ignore[method-assign]
        elif conv1d is not None and isinstance(sub, conv1d):
            sub.forward = functools.partial(_conv1d_forward, sub)
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
