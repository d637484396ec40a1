"""What the parts of the container check share: the names of what it builds, its log, its
checks.

``__main__.py`` is the entry (its docstring says what the run does); its parts live beside it:
the stand-in bases, the images and the checks of them in _images.py, the compose services as
containers in _stack.py, the load and the kill/SIGTERM phases in _load.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
LABEL = "batchline.containers"
PY_BASE = "batchline-standin/python:3.11-bookworm"
REDIS_BASE = "batchline-standin/redis:7-bookworm"
WORKER_IMAGE = "batchline-ci/worker:latest"
API_IMAGE = "batchline-ci/api:latest"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def require(ok: bool, message: str) -> None:
    """A check of the run (not an assert: it holds under python -O too)."""
    if not ok:
        raise AssertionError(message)


def wait_for(
    what: str, check: Callable[[], bool], *, timeout_s: float, every_s: float = 1.0
) -> None:
    """Poll ``check`` until it is true; raise after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(every_s)
