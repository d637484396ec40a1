"""An embeddings answer: the worker's matrix checked (:func:`embedding_matrix`, which TEI's
``/embed`` shares), then written in OpenAI's shape, floats or base64 (:func:`embedding_body`)."""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np

from batchline.codec import non_finite

__all__ = ["embedding_body", "embedding_matrix"]


def embedding_matrix(output: Any, rows: int) -> np.ndarray[Any, Any]:
    """A worker's output for ``rows`` texts as a matrix, one row each (OpenAI's answer and
    TEI's alike); ValueError for any other shape, and for a NaN or an infinity in it."""
    matrix = np.asarray(output)
    if matrix.ndim != 2 or matrix.shape[0] != rows:
        raise ValueError(f"the embedding worker answered shape {matrix.shape} for {rows} texts")
    where = non_finite(matrix)
    if where is not None:  # no JSON holds it, and base64 would hand the client garbage
        raise ValueError(f"the model's vectors hold {where} (row, column): not sent")
    return matrix


def embedding_body(
    model: str,
    matrix: np.ndarray[Any, Any],
    encoding: Literal["float", "base64"],
    tokens: int,
    *,
    lazy: bool = False,
) -> dict[str, Any]:
    """A ``list`` of ``embedding`` objects, one per row of ``matrix``. ``base64``: each
    vector's little-endian float32 bytes. ``tokens``: the input's, as the model's tokenizer
    counted them (0: the worker did not say). ``lazy``: ``data`` an iterator that makes each
    object as it is read (a batch line's answer, encoded a piece at a time), not a list."""

    def item(i: int, row: np.ndarray[Any, Any]) -> dict[str, Any]:
        vector: Any = (
            base64.b64encode(row.astype("<f4").tobytes()).decode()
            if encoding == "base64"
            else row.astype(float).tolist()
        )
        return {"object": "embedding", "index": i, "embedding": vector}

    data = (item(i, row) for i, row in enumerate(matrix))
    return {
        "object": "list",
        "data": data if lazy else list(data),
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
