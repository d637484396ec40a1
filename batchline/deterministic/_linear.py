"""Deterministic mode's ``Linear``: rows padded to a multiple of a tile probed per weight
(see :mod:`batchline.deterministic`)."""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["ROW_TILE", "TILES", "conv1d_forward", "linear_forward", "row_tile", "tiled_linear"]

#: The largest row tile: a ``Linear``'s rows are padded with zeros to a multiple of it
#: where no smaller tile is found to hold (measured to hold up to 1,024 rows on the
#: project's CPU); a prompt's attention is computed in tiles of this many queries.
ROW_TILE = 64


#: The row tiles :func:`row_tile` tries, smallest first. None is 1: a row alone takes a
#: GEMM path of its own in bfloat16 too, and a probe does not always see it (the outputs
#: it rounds differently are rare: a vocabulary head of 97 showed one in a generation's
#: steps, none in a probe's 100,000 outputs).
TILES = (4, 16, ROW_TILE)


#: Multiples of a tile that a probe runs the same rows in, as many rows a GEMM.
_PROBE = (1, 2, 3, 5, 9, 33)


#: A probe compares this many outputs of each GEMM (rows x outputs): a kernel that
#: accumulates in float32 and rounds to bfloat16 shows a different order of sums in a few
#: outputs in 100,000 only.
_PROBE_OUTPUTS = 1 << 19


def tiled_linear(x: Any, weight: Any, bias: Any = None, tile: int = ROW_TILE) -> Any:
    """``torch.nn.functional.linear(x, weight, bias)`` in one GEMM over a multiple of
    ``tile`` rows: the rows of ``x`` (all its dimensions but the last, flattened), copied
    with zero rows after them where their number is not one already. (A tile of its own for
    the rows left over costs more: a GEMM of 64 rows took 40 % of the time of one of 1,312
    in bfloat16.)"""
    import torch

    if tile == 1:
        return torch.nn.functional.linear(x, weight, bias)
    width = x.shape[-1]
    flat = x.reshape(-1, width)
    rows = flat.shape[0]
    padded = -(-rows // tile) * tile
    if padded != rows:
        buffer = flat.new_empty((padded, width))
        buffer[:rows] = flat
        buffer[rows:] = 0
        flat = buffer
    else:
        flat = flat.contiguous()
    out = torch.nn.functional.linear(flat, weight, bias)
    return out[:rows].reshape(*x.shape[:-1], weight.shape[0])


def row_tile(weight: Any, bias: Any = None) -> int:
    """The smallest tile of :data:`TILES` at which a ``Linear`` with this ``weight`` (its
    shape, dtype, device and layout) and ``bias`` (present or not) gives every row the
    same bits whichever multiple of the tile its GEMM runs over (probed: the same rows run
    all at once and a few rows a GEMM, every output compared), with torch's current
    thread count; :data:`ROW_TILE` where no smaller one does (not probed). Each kind of
    weight is probed once, on random values: a GEMM's paths depend on the shapes, not
    the values."""
    import torch

    return _probed(
        tuple(weight.shape),
        transposed=weight.stride() != (weight.shape[1], 1),
        bias=bias is not None,
        dtype=weight.dtype,
        device=str(weight.device),
        threads=torch.get_num_threads(),
    )


@functools.cache
def _probed(
    shape: tuple[int, int],
    *,
    transposed: bool,
    bias: bool,
    dtype: Any,
    device: str,
    threads: int,
) -> int:
    import torch

    out_features, in_features = shape
    generator = torch.Generator().manual_seed(0)

    def randn(*size: int) -> Any:
        return torch.randn(*size, generator=generator).to(dtype=dtype, device=device)

    weight = randn(in_features, out_features).t() if transposed else randn(*shape)
    weight = weight / in_features**0.5  # outputs of the size a model's are
    b = randn(out_features) if bias else None
    rows = max(16, min(1024, _PROBE_OUTPUTS // out_features))
    x = randn(rows, in_features)
    for tile in TILES[:-1]:
        whole = tiled_linear(x, weight, b, tile)
        if all(
            torch.equal(
                torch.cat([tiled_linear(x[i : i + m], weight, b, tile) for i in range(0, rows, m)]),
                whole,
            )
            for m in (tile * k for k in _PROBE)
        ):
            return tile
    return ROW_TILE


def _bits(t: Any) -> bytes:
    return bytes(t.detach().float().cpu().contiguous().numpy().tobytes())


def linear_forward(module: Any, tile: int, x: Any) -> Any:
    return tiled_linear(x, module.weight, module.bias, tile)


def conv1d_forward(module: Any, tile: int, x: Any) -> Any:
    """transformers' ``Conv1D`` (GPT-2's linears: ``x @ weight + bias``) through
    :func:`tiled_linear`."""
    return tiled_linear(x, module.weight.t(), module.bias, tile)
