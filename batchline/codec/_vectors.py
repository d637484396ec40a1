"""Embeddings as they travel: ``<f4`` rows, of unit length where the model normalises them
(docs/protocol.md, Values). One rule for the worker's model kinds and the web routes that
renormalise (OpenAI's ``dimensions``, TEI's ``normalize``)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["unit_rows"]


def unit_rows(matrix: Any) -> np.ndarray[Any, Any]:
    """Each row of ``matrix`` (one vector per row) scaled to length 1, as float32; a zero
    row stays zero. The norms and the division are computed in float64, so that each
    float32 row's length is 1 within float32's rounding (about 1e-7), whatever precision
    the vectors were computed in."""
    wide = np.asarray(matrix, dtype=np.float64)
    if wide.ndim != 2:
        raise ValueError(f"expected a matrix of vectors, one per row; got shape {wide.shape}")
    norms = np.linalg.norm(wide, axis=1, keepdims=True)
    out: np.ndarray[Any, Any] = np.divide(wide, norms, out=np.zeros_like(wide), where=norms > 0)
    return out.astype(np.float32)
