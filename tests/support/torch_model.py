"""A model module that loads torch as it is imported (as a real model's ``load`` does), for
the threading tests: ``report`` answers each item with the threading torch runs under in
the worker's process."""

from __future__ import annotations

import os
from typing import Any

import torch

_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "TOKENIZERS_PARALLELISM")


def report(items: list[Any]) -> list[dict[str, Any]]:
    state: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "interop": torch.get_num_interop_threads(),
    }
    state.update({name: os.environ.get(name) for name in _VARIABLES})
    return [state for _ in items]
