"""An embedding model for the Batch API's tests that counts its calls and can be held.

``counting_embed`` embeds as ``web_models.embed`` does, one text at a time, counting each
text it computes in :data:`CALLS` (workers run as threads of the test's process). After
:data:`HOLD_AFTER` texts in all it waits for :data:`GATE` before each further one: a test
holds a batch part way, acts (cancels, kills the API), then opens the gate.

``wide_embed`` answers each text a vector of :data:`WIDE_DIM` float32 with every digit set
(a third): answers as large as a real model's, at no cost.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import numpy as np

from tests.support.web_models import embed

CALLS: Counter[str] = Counter()
GATE = threading.Event()
#: Texts computed before the model waits for GATE (None: never waits).
HOLD_AFTER: list[int | None] = [None]
_LOCK = threading.Lock()
#: The size of ``wide_embed``'s vectors.
WIDE_DIM = 768


def reset(hold_after: int | None = None) -> None:
    """Forget the calls; hold after ``hold_after`` texts (None: never)."""
    with _LOCK:
        CALLS.clear()
        HOLD_AFTER[0] = hold_after
        GATE.clear()


def counting_embed(items: list[Any]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        limit = HOLD_AFTER[0]
        if limit is not None and sum(CALLS.values()) >= limit:
            GATE.wait(timeout=60)
        with _LOCK:
            CALLS.update([item] if isinstance(item, str) else item)
        out.extend(embed([item]))
    return out


def wide_embed(items: list[Any]) -> list[Any]:
    shapes = [(len(item), WIDE_DIM) if isinstance(item, list) else (WIDE_DIM,) for item in items]
    return [np.full(shape, 1 / 3, dtype=np.float32) for shape in shapes]
