"""Padding: features split into rows, rows collated into a padded batch, outputs split back.

Pure functions on numpy arrays and torch tensors (torch is used only if the caller already
imported it: this module never imports it). A *feature* is one named input with the batch
as its first dimension: an array, a tensor, or a list of per-row arrays or tensors. A *row*
is one item's slice of every feature.

- :func:`split_rows` turns a caller's features into rows (validating them for that caller);
- :func:`collate` pads the rows of a batch into one array per feature: every ragged
  dimension is padded (not only the sequence one) with the feature's pad value, on the
  right or the left, and the dtype and device are kept (mixed dtypes are promoted);
- :func:`split_outputs` cuts the function's outputs (an array, or a list, tuple or dict of
  them) back into rows; an output dimension that carries a padded dimension of the
  reference feature (the first one) is trimmed to that row's own size;
- :func:`stack_rows` puts one caller's output rows back together.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from batchline.errors import BatchFunctionError

__all__ = [
    "PadInfo",
    "collate",
    "is_tensor",
    "row_length",
    "split_outputs",
    "split_rows",
    "stack_rows",
]

Side = Literal["left", "right"]
Row = dict[str, Any]


def is_tensor(value: object) -> bool:
    """True for a torch.Tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _is_array(value: object) -> bool:
    return isinstance(value, np.ndarray) or is_tensor(value)


@dataclass(frozen=True, slots=True)
class PadInfo:
    """What :func:`collate` did, for splitting the outputs back.

    Attributes:
        rows: rows in the batch.
        shapes: each row's own shape of the reference feature (the first one).
        padded: the reference feature's padded row shape.
        ragged: per dimension of ``padded``, whether any row was padded there.
        side: where padding went.
        real: elements of real data in the reference feature.
        total: elements after padding.
    """

    rows: int
    shapes: tuple[tuple[int, ...], ...]
    padded: tuple[int, ...]
    ragged: tuple[bool, ...]
    side: Side
    real: int
    total: int


def split_rows(features: Mapping[str, Any]) -> list[Row]:
    """One dict per row from a caller's features; ValueError/TypeError name what is wrong."""
    if not isinstance(features, Mapping) or not features:
        raise TypeError(
            "features must be a non-empty dict of name -> array, tensor, or list of them; "
            f"got {type(features).__name__}"
        )
    columns: dict[str, Sequence[Any]] = {}
    for name, value in features.items():
        if _is_array(value):
            if value.ndim == 0:
                raise ValueError(f"feature {name!r} is a scalar: its first dimension is the batch")
            columns[name] = value.unbind(0) if is_tensor(value) else list(value)
        elif isinstance(value, list | tuple):
            bad = next((v for v in value if not _is_array(v)), None)
            if bad is not None:
                raise TypeError(
                    f"feature {name!r}: a list feature holds arrays or tensors, "
                    f"got {type(bad).__name__}"
                )
            columns[name] = value
        else:
            raise TypeError(
                f"feature {name!r} must be an array, a tensor or a list of them, "
                f"got {type(value).__name__}"
            )
    counts = {name: len(col) for name, col in columns.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"features disagree on the number of rows: {counts}")
    count = next(iter(counts.values()))
    if count == 0:
        raise ValueError("features hold no rows")
    return [{name: col[i] for name, col in columns.items()} for i in range(count)]


def row_length(row: Row) -> int:
    """A row's length in tokens: the first dimension of its first (reference) feature."""
    ref = next(iter(row.values()))
    return int(ref.shape[0]) if ref.ndim else 1


def _common_dtype(rows: Sequence[Any], torch_mode: bool) -> Any:
    if torch_mode:
        torch = sys.modules["torch"]
        dtype = rows[0].dtype
        for row in rows[1:]:
            if row.dtype != dtype:
                dtype = torch.promote_types(dtype, row.dtype)
        return dtype
    return np.result_type(*rows)


def _collate_feature(
    name: str, rows: Sequence[Any], pad: Any, side: Side
) -> tuple[Any, tuple[int, ...], tuple[tuple[int, ...], ...]]:
    torch_mode = is_tensor(rows[0])
    if any(is_tensor(r) != torch_mode for r in rows):
        raise TypeError(f"feature {name!r} mixes numpy arrays and torch tensors in one batch")
    shapes = tuple(tuple(int(n) for n in r.shape) for r in rows)
    ndim = len(shapes[0])
    if any(len(s) != ndim for s in shapes):
        ranks = sorted({len(s) for s in shapes})
        raise ValueError(f"feature {name!r}: rows differ in rank: {ranks}")
    if torch_mode and len({r.device for r in rows}) > 1:
        raise ValueError(f"feature {name!r}: rows live on different devices")
    target = tuple(max(s[d] for s in shapes) for d in range(ndim))
    dtype = _common_dtype(rows, torch_mode)
    if all(s == target for s in shapes):
        if torch_mode:
            torch = sys.modules["torch"]
            return torch.stack([r.to(dtype) for r in rows]), target, shapes
        return np.stack(rows).astype(dtype, copy=False), target, shapes
    full = (len(rows), *target)
    if torch_mode:
        torch = sys.modules["torch"]
        out = torch.full(full, pad, dtype=dtype, device=rows[0].device)
    else:
        out = np.full(full, pad, dtype=dtype)
    for i, (row, shape) in enumerate(zip(rows, shapes, strict=True)):
        out[(i, *_place(shape, target, side))] = row
    return out, target, shapes


def _place(shape: tuple[int, ...], target: tuple[int, ...], side: Side) -> tuple[slice, ...]:
    if side == "right":
        return tuple(slice(0, n) for n in shape)
    return tuple(slice(t - n, t) for n, t in zip(shape, target, strict=True))


def collate(
    rows: Sequence[Row], pad_tokens: Mapping[str, Any], side: Side = "right", default_pad: Any = 0
) -> tuple[dict[str, Any], PadInfo]:
    """Pad and stack rows into one batch per feature (unnamed features pad with default_pad)."""
    names = list(rows[0])
    if any(list(r) != names for r in rows):
        raise ValueError(f"rows in one batch must share the same features, expected {names}")
    batch: dict[str, Any] = {}
    info: PadInfo | None = None
    for name in names:
        column = [r[name] for r in rows]
        out, target, shapes = _collate_feature(
            name, column, pad_tokens.get(name, default_pad), side
        )
        batch[name] = out
        if info is None:
            info = PadInfo(
                rows=len(rows),
                shapes=shapes,
                padded=target,
                ragged=tuple(any(s[d] != t for s in shapes) for d, t in enumerate(target)),
                side=side,
                real=sum(int(np.prod(s)) for s in shapes),
                total=len(rows) * int(np.prod(target)),
            )
    if info is None:  # pragma: no cover - split_rows never makes a row without features
        raise ValueError("rows hold no features")
    return batch, info


def _trim(value: Any, first_dim: int, own: tuple[int, ...], info: PadInfo) -> Any:
    """Cut a row's output back to the row's own size along the padded reference dims."""
    index: list[slice] = []
    changed = False
    for d in range(first_dim, value.ndim):
        k = d - first_dim
        if k < len(info.padded) and info.ragged[k] and value.shape[d] == info.padded[k]:
            n, t = own[k], info.padded[k]
            index.append(slice(0, n) if info.side == "right" else slice(t - n, t))
            changed = changed or n != t
        else:
            index.append(slice(None))
    return value[tuple(index)] if changed else value


def _split_leaf(value: Any, info: PadInfo, where: str) -> list[Any]:
    if _is_array(value):
        if value.ndim == 0 or value.shape[0] != info.rows:
            got = "a scalar" if value.ndim == 0 else f"{value.shape[0]} rows"
            raise BatchFunctionError(f"output {where} has {got} for {info.rows} inputs")
        return [_trim(value[i], 0, info.shapes[i], info) for i in range(info.rows)]
    if isinstance(value, list | tuple) and all(_is_array(v) for v in value):
        if len(value) != info.rows:
            raise BatchFunctionError(f"output {where} has {len(value)} rows for {info.rows} inputs")
        return [_trim(v, 0, info.shapes[i], info) for i, v in enumerate(value)]
    raise BatchFunctionError(
        f"output {where} must be an array, a tensor or a list of them, got {type(value).__name__}"
    )


def _is_multi(outputs: Sequence[Any], rows: int) -> bool:
    """A list/tuple output holds several outputs unless it is one per-row list of arrays."""
    return all(
        (_is_array(v) and v.ndim > 0 and v.shape[0] == rows)
        or (isinstance(v, list | tuple) and len(v) == rows)
        for v in outputs
    )


def split_outputs(outputs: Any, info: PadInfo) -> list[Any]:
    """Per-row outputs (same structure as ``outputs``), trimmed to each row's own size."""
    if isinstance(outputs, Mapping):
        parts = {k: _split_leaf(v, info, repr(k)) for k, v in outputs.items()}
        return [{k: part[i] for k, part in parts.items()} for i in range(info.rows)]
    if isinstance(outputs, list | tuple) and outputs and _is_multi(outputs, info.rows):
        kind = type(outputs)
        cols = [_split_leaf(v, info, f"[{j}]") for j, v in enumerate(outputs)]
        return [kind(col[i] for col in cols) for i in range(info.rows)]
    return _split_leaf(outputs, info, "")


def stack_rows(rows: Sequence[Any]) -> Any:
    """One caller's output rows back into a batch: stacked where shapes agree, else a list."""
    first = rows[0]
    if isinstance(first, Mapping):
        return {k: stack_rows([r[k] for r in rows]) for k in first}
    if isinstance(first, list | tuple):
        return type(first)(stack_rows([r[j] for r in rows]) for j in range(len(first)))
    if any(r.shape != first.shape for r in rows):
        return list(rows)
    if is_tensor(first):
        return sys.modules["torch"].stack(list(rows))
    return np.stack(rows)
