"""Deterministic mode's attention: a transformers attention function whose every
sequence's result does not depend on the batch (see :mod:`batchline.deterministic`)."""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from batchline.deterministic._linear import ROW_TILE

__all__ = ["ATTENTION", "per_sequence_attention", "prompt_pass"]

#: The name of :func:`per_sequence_attention` among transformers' attention functions.
ATTENTION = "batchline_deterministic"


_PROMPT: contextvars.ContextVar[bool] = contextvars.ContextVar("batchline_prompt", default=False)


@contextlib.contextmanager
def prompt_pass() -> Iterator[None]:
    """Within it, a causal model's forward passes feed prompt tokens: their attention is
    computed in position-aligned tiles even for one query (see the module docstring), as
    the other chunks of the same prompt are. Outside, a pass of one query is a decoding
    step. Nothing changes for a model not in deterministic mode."""
    token = _PROMPT.set(True)
    try:
        yield
    finally:
        _PROMPT.reset(token)


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
    ``query`` positions of them (self-attention, a cache before them). A causal model's
    pass runs in :func:`_blocked`'s units (a prompt's queries in position-aligned tiles, a
    decoding step's one query a sequence). Any other pass gathers each sequence's queries,
    keys, values and mask without the padding, and ``scaled_dot_product_attention`` runs
    on them with its mask, or None where that masks nothing, one call a sequence: the call
    it gets alone. Padded queries' outputs are zeros. The mask may be boolean (True:
    attend) or additive; None is full attention, or causal where the module (or
    ``is_causal``) says so.
    """
    import torch

    if dropout:
        raise ValueError(f"deterministic attention is for inference, got dropout {dropout}")
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]

    def allowed_keys() -> Any:
        return _allowed(
            module,
            attention_mask,
            is_causal=is_causal,
            query=query,
            batch=batch,
            q_len=q_len,
            k_len=k_len,
        )

    if is_causal if is_causal is not None else getattr(module, "is_causal", False):
        prompt = q_len > 1 or _PROMPT.get()  # else a decoding step: one query a sequence
        plan = _plan_of(attention_mask, allowed_keys, query, key, prompt=prompt)
        return _blocked(plan, query, key, value, scaling), None
    # Grouped-query attention: the key heads are shared by groups of query heads
    # (``enable_gqa``), not copied.
    gqa = key.shape[1] != query.shape[1]
    allowed = allowed_keys()
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.expand(batch, 1, q_len, k_len)
    out = query.new_zeros((batch, q_len, heads, value.shape[-1]))
    patterns, which = torch.unique(allowed.any(dim=1), dim=0, return_inverse=True)
    for index, pattern in enumerate(patterns):
        tokens = pattern.nonzero().squeeze(1)
        mine = tokens[tokens >= k_len - q_len] - (k_len - q_len)
        if mine.numel() == 0:
            continue
        rows = (which == index).nonzero().squeeze(1)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            masks = _cut(attention_mask, rows, mine, tokens)
            unmasked = (masks == 0).flatten(1).all(dim=1)
        else:
            masks = _cut(allowed.unsqueeze(1), rows, mine, tokens)
            unmasked = masks.flatten(1).all(dim=1)
        keys_at, queries_at = _span(tokens), _span(mine)
        for row, full, mask in zip(rows.tolist(), unmasked.tolist(), masks, strict=True):
            # One call a row: a call over several rows rounded differently from one over
            # a row alone at some shapes (float32, heads of 8: batch 1 against 2 and more).
            # A row's tokens are a view where they are contiguous (no padding between).
            q = _take(query[row : row + 1], queries_at)
            k, v = _take(key[row : row + 1], keys_at), _take(value[row : row + 1], keys_at)
            result = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if full else mask.unsqueeze(0),
                scale=scaling,
                enable_gqa=gqa,
            )
            out[row, mine] = result[0].transpose(0, 1)
    return out, None


@dataclass(frozen=True, slots=True)
class _Plan:
    """Where a causal pass's queries and keys go in :func:`_blocked`'s units: a unit is a
    sequence's decoding query, or a tile of :data:`ROW_TILE` positions of its prompt, with
    the sequence's keys from its first, in blocks of :data:`ROW_TILE`."""

    units: int
    slots: int  # query slots a unit (1, or ROW_TILE)
    blocks: int  # key blocks a unit
    queries: Any  # [units x slots]: the row of (batch x queries) each slot reads (absent: 0)
    keys: Any  # [units x key heads x blocks x ROW_TILE]: rows of (batch x key heads x keys)
    bias: Any  # [units, 1, 1, slots, blocks x ROW_TILE]: 0 where a slot attends a key, -inf
    sources: Any  # the slots that are queries, in (units x slots)
    targets: Any  # their rows of (batch x queries)
    whole: bool  # a decoding pass of every row: the units are the batch's rows, in order


#: The last plan made, and the mask it was made for (a pass's layers share one mask).
_LAST: list[tuple[Any, tuple[Any, ...], _Plan]] = []


def _plan_of(
    attention_mask: Any, allowed: Callable[[], Any], query: Any, key: Any, *, prompt: bool
) -> _Plan:
    """The plan for this pass: made once for its first layer (from ``allowed()``, the keys
    each query may attend to), kept for the others (the same mask object, shapes and kind
    of pass)."""
    shape = (tuple(query.shape[:3]), tuple(key.shape[:3]), prompt, key.dtype, str(key.device))
    if _LAST:
        ref, was, plan = _LAST[0]
        mask = ref() if ref is not None else None
        if was == shape and mask is attention_mask and (ref is None) == (mask is None):
            return plan
    plan = _make_plan(allowed(), key.shape[1], prompt=prompt, device=key.device, dtype=key.dtype)
    _LAST[:] = [(weakref.ref(attention_mask) if attention_mask is not None else None, shape, plan)]
    return plan


def _make_plan(allowed: Any, kv_heads: int, *, prompt: bool, device: Any, dtype: Any) -> _Plan:
    import torch

    allowed = allowed.cpu()
    batch, q_len, k_len = allowed.shape
    slots = ROW_TILE if prompt else 1
    units: list[tuple[int, Any, int, int]] = []  # (batch row, its key columns, first, tile)
    for b, seen in enumerate(allowed.any(dim=1)):
        tokens = seen.nonzero().squeeze(1)
        n = tokens.numel()
        mine = int((tokens >= k_len - q_len).sum())  # its queries: the last of its tokens
        if not mine:
            continue
        first = n - mine if prompt else n - 1
        for tile in range(first // slots, (n - 1) // slots + 1):
            units.append((b, tokens, first, tile))
    # A unit's keys: its sequence's up to its tile's end.
    blocks = max(-(-min(keys.numel(), (t + 1) * slots) // ROW_TILE) for _, keys, _, t in units)
    width = blocks * ROW_TILE
    keys = torch.zeros((len(units), width), dtype=torch.long)
    mask = torch.zeros((len(units), slots, width), dtype=torch.bool)
    queries = torch.zeros((len(units), slots), dtype=torch.long)
    present = torch.zeros((len(units), slots), dtype=torch.bool)
    rows_of = torch.zeros(len(units), dtype=torch.long)
    for u, (b, tokens, first, tile) in enumerate(units):
        n = tokens.numel()
        rows_of[u] = b
        have = min(n, width)
        keys[u, :have] = tokens[:have]
        start = tile * slots
        lo, hi = max(first, start), min(n, start + slots)
        columns = tokens[lo:hi] - (k_len - q_len)  # the query columns of positions lo..hi
        queries[u, lo - start : hi - start] = b * q_len + columns
        present[u, lo - start : hi - start] = True
        mask[u, lo - start : hi - start, :have] = allowed[b, columns][:, tokens[:have]]
        mask[u, :, 0] |= ~present[u]  # a slot without a query attends to one key (unused)
    heads = rows_of[:, None] * kv_heads + torch.arange(kv_heads)[None, :]
    key_rows = heads[:, :, None] * k_len + keys[:, None, :]
    sources = present.reshape(-1).nonzero().squeeze(1)
    bias = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))[:, None, None]
    return _Plan(
        units=len(units),
        slots=slots,
        blocks=blocks,
        queries=queries.reshape(-1).to(device),
        keys=key_rows.reshape(-1).to(device),
        bias=bias.to(device),
        sources=sources.to(device),
        targets=queries.reshape(-1)[sources].to(device),
        whole=slots == 1 and len(units) == batch and q_len == 1,
    )


def _blocked(plan: _Plan, query: Any, key: Any, value: Any, scaling: float | None) -> Any:
    """A pass's attention, every sequence's units at once, each unit's arithmetic the same
    whatever the others: its queries' scores over each block of its keys are GEMMs of one
    shape; the softmax runs over all the blocks' scores, those past a unit's keys masked
    (the same result for any number of masked blocks after them: measured, and held by
    the tests); each block's weighted values are GEMMs of one shape again, added in the
    blocks' order (the masked blocks add zeros). As transformers' eager attention, scores
    and weighted values are computed in the model's dtype, the softmax in float32.
    Returns [batch, queries, heads, dim]."""
    import torch

    batch, heads, q_len, dim = query.shape
    kv_heads, v_dim = key.shape[1], value.shape[-1]
    groups = heads // kv_heads
    units, slots, blocks = plan.units, plan.slots, plan.blocks
    rows = groups * slots
    if plan.whole:  # a decoding step: the rows' queries as they are
        q = query.reshape(units, kv_heads, 1, groups, dim)
    else:
        q = query.transpose(1, 2).reshape(batch * q_len, heads, dim)
        q = q.index_select(0, plan.queries).view(units, slots, heads, dim)
        q = q.permute(0, 2, 1, 3).reshape(units, kv_heads, 1, rows, dim)
    k = key.reshape(-1, dim).index_select(0, plan.keys)
    v = value.reshape(-1, v_dim).index_select(0, plan.keys)
    k = k.view(units, kv_heads, blocks, ROW_TILE, dim)
    v = v.view(units, kv_heads, blocks, ROW_TILE, v_dim)
    scores = torch.matmul(q, k.transpose(-1, -2))  # [u, kv, blocks, rows, tile]
    scores = scores.transpose(2, 3).reshape(units, kv_heads, groups, slots, blocks * ROW_TILE)
    scores.mul_(scaling if scaling is not None else dim**-0.5).add_(plan.bias)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    weights = weights.view(units, kv_heads, rows, blocks, ROW_TILE).transpose(2, 3)
    parts = torch.matmul(weights, v)  # [u, kv, blocks, rows, dim]
    out = parts[:, :, 0].float()
    for block in range(1, blocks):
        out = out + parts[:, :, block]
    out = out.to(query.dtype).view(units, heads, slots, v_dim).transpose(1, 2)
    if plan.whole:
        return out
    out = out.reshape(units * slots, heads, v_dim).index_select(0, plan.sources)
    result = query.new_zeros((batch * q_len, heads, v_dim))
    result.index_copy_(0, plan.targets, out)
    return result.view(batch, q_len, heads, v_dim)


def _span(index: Any) -> Any:
    """``index`` (sorted positions) as a slice where it is a contiguous run."""
    first, last = int(index[0]), int(index[-1])
    return slice(first, last + 1) if last - first + 1 == index.numel() else index


def _take(t: Any, at: Any) -> Any:
    """``t``'s positions ``at`` (a slice, or an index tensor) on dim 2."""
    return t[:, :, at] if isinstance(at, slice) else t.index_select(2, at)


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
