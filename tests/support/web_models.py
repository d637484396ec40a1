"""Batch functions for the FastAPI backend's tests: ``embed`` and ``generation_echo``.

``embed``: each input is a text (its output a vector of 3 float32) or a list of texts (a
matrix, one row each). Two texts fail on purpose: ``BAD_INPUT`` with a ValueError (the
input's fault), ``MODEL_FAILURE`` with a RuntimeError (the model's); ``NOT_FINITE`` gives a
vector with a NaN and an infinity.

``generation_echo``: answers a generation request (docs/protocol.md, Generation) with the
request itself, as JSON, for its text: what the worker received, parameters and all.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

BAD_INPUT = "this input is refused"
MODEL_FAILURE = "this input breaks the model"
#: Its vector holds a NaN and an infinity: what a model that overflowed gives.
NOT_FINITE = "this input overflows the model"


def vector(text: str) -> list[float]:
    """The embedding ``embed`` gives a text."""
    if text == BAD_INPUT:
        raise ValueError("the test model refuses this text")
    if text == MODEL_FAILURE:
        raise RuntimeError("the test model broke")
    if text == NOT_FINITE:
        return [float("nan"), float("inf"), 0.5]
    return [float(len(text)), float(sum(map(ord, text)) % 1000), 0.5]


def embed(items: list[Any]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        if isinstance(item, str):
            out.append(np.asarray(vector(item), dtype=np.float32))
        else:
            out.append(np.asarray([vector(t) for t in item], dtype=np.float32))
    return out


def generation_echo(items: list[Any]) -> list[Any]:
    return [
        {"text": json.dumps(item), "finish_reason": "length", "prompt_tokens": 1, "tokens": 1}
        for item in items
    ]


def generation_bad_logprobs(items: list[Any]) -> list[Any]:
    """A generation answer whose logprobs do not match its tokens (a broken worker)."""
    return [
        {
            "text": "ab",
            "token_ids": [1, 2],
            "logprobs": [[-0.5, "a", []]],
            "finish_reason": "length",
            "prompt_tokens": 1,
            "tokens": 2,
        }
        for _ in items
    ]
