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
    """``torch.nn.functional.linear(x, weight, bias)`` with the rows of ``x`` (all its
    dimensions but the last, flattened) copied into a zero-padded buffer whose row count is
    a multiple of :data:`ROW_TILE`: one GEMM whose kernel does not change with the batch."""
    import torch

    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    padded = -(-rows // ROW_TILE) * ROW_TILE
    buffer = x.new_zeros((padded, x.shape[-1]))
    buffer[:rows] = x.reshape(rows, x.shape[-1])
    out = torch.nn.functional.linear(buffer, weight, bias)[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _linear_forward(module: Any, x: Any) -> Any:
    return tiled_linear(x, module.weight, module.bias)


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
    attended alone, over its own tokens only.

    A sequence's tokens are the keys some query may attend to; its queries are the last
    ``query`` positions of them (self-attention, a cache before them). Its queries, keys,
    values and mask are gathered without the padding, and
    ``scaled_dot_product_attention`` runs on them with the mask (None where it masks
    nothing): the call a sequence gets alone. Padded queries' outputs are zeros. The mask
    may be boolean (True: attend) or additive; None is full attention, or causal where
    the module (or ``is_causal``) says so.
    """
    import torch

    if dropout:
        raise ValueError(f"deterministic attention is for inference, got dropout {dropout}")
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
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
    out = query.new_zeros((batch, q_len, heads, value.shape[-1]))
    for b in range(batch):
        attend = allowed[b]  # (q_len, k_len), True: attend
        tokens = attend.any(dim=0).nonzero().squeeze(1)
        mine = tokens[tokens >= k_len - q_len] - (k_len - q_len)
        if mine.numel() == 0:
            continue
        mask = attend.index_select(0, mine).index_select(1, tokens)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            # An additive mask keeps its values (a bias, as ALiBi's), cut as the tokens are.
            mask = attention_mask[b, 0].expand(q_len, k_len)[mine][:, tokens]
            mask = None if bool((mask == 0).all()) else mask
        elif bool(mask.all()):
            mask = None
        result = torch.nn.functional.scaled_dot_product_attention(
            query[b : b + 1].index_select(2, mine),
            key[b : b + 1].index_select(2, tokens),
            value[b : b + 1].index_select(2, tokens),
            attn_mask=mask,
            scale=scaling,
        )
        out[b].index_copy_(0, mine, result[0].transpose(0, 1))
    return out, None


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
    ``Linear`` layers compute through :func:`tiled_linear`, and each transformers model in
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
    for sub in model.modules():
        if isinstance(sub, torch.nn.Linear):
            sub.forward = functools.partial(_linear_forward, sub)  # type: ignore[method-assign]
    if models:
        _register()
    for sub in models:
        sub.config._attn_implementation = ATTENTION
    return model


def _is_transformers_model(module: Any) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers ships with the torch extras
        return False
    return isinstance(module, PreTrainedModel)
