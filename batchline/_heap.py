"""What a long-running batchline process holds once started, out of the garbage collector's
walks (:func:`gc.freeze`).

A full collection walks every object the process tracks, holding the GIL: in a worker that
loaded a torch model (millions of objects) the model waits between batches meanwhile, and in
the HTTP API (FastAPI, pydantic, the producers: about 90,000 objects) no answer is delivered
while it runs. Frozen objects are still freed when nothing refers to them; only a reference
cycle among them would stay in memory.
"""

from __future__ import annotations

import functools
import gc

__all__ = ["freeze", "freeze_once"]


def freeze() -> None:
    """Collect once, then freeze what is left (the worker, after each model load)."""
    gc.collect()
    gc.freeze()


@functools.cache
def freeze_once() -> None:
    """:func:`freeze`, the first time this process calls it (an app's start: a process
    that starts several apps, a test run, collects and freezes once)."""
    freeze()
