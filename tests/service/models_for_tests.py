"""Batch functions for the service tests, served as ``module:callable`` by workers.

Workers in subprocesses import this module by name, so it has no test-only imports. Their
behaviour is steered by environment variables (not ``BATCHLINE_*``, which the settings
reject as unknown):

- ``BLTEST_RECORD_FILE``: ``record_batches``, ``slow``, ``crash``, ``abort`` and ``hang``
  append each batch they are given to this file, one JSON list per line, before doing
  anything else with it;
- ``BLTEST_SLOW_S``: how long ``slow`` sleeps per batch; ``BLTEST_HANG_S``: how long
  ``hang`` hangs.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from batchline.worker import Prepared

CRASH_EXIT_CODE = 77


def _record(items: list[Any]) -> None:
    path = os.environ.get("BLTEST_RECORD_FILE")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(items, default=repr) + "\n")


def read_batches(path: Path) -> list[list[Any]]:
    """The batches recorded in ``path`` so far (none if it does not exist yet)."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    # The last line may be half written by a process still running: keep whole lines only.
    return [json.loads(line) for line in lines if line.endswith("]")]


def echo(items: list[Any]) -> list[Any]:
    return items


def double(items: list[Any]) -> list[Any]:
    return [x * 2 for x in items]


def poison(items: list[Any]) -> list[Any]:
    """Raises ValueError for any batch holding "poison"; echoes the rest."""
    if "poison" in items:
        raise ValueError("poisoned input")
    return items


def record_batches(items: list[Any]) -> list[Any]:
    _record(items)
    return items


def slow(items: list[Any]) -> list[Any]:
    _record(items)
    time.sleep(float(os.environ.get("BLTEST_SLOW_S", "0")))
    return items


def slow_double(items: list[Any]) -> list[Any]:
    """``double``, recorded and slowed as ``slow`` is."""
    _record(items)
    time.sleep(float(os.environ.get("BLTEST_SLOW_S", "0")))
    return [x * 2 for x in items]


def crash(items: list[Any]) -> list[Any]:
    """Kills its whole process (no clean-up at all) when a batch holds "crash"."""
    _record(items)
    if "crash" in items:
        os._exit(CRASH_EXIT_CODE)
    return items


def wrong_length(items: list[Any]) -> list[Any]:
    return items[:-1]


def not_serializable(items: list[Any]) -> list[Any]:
    return [object() for _ in items]


class GatedModel:
    """A Model (the worker's protocol) that holds every batch until the test opens the gate.

    For workers running in the test process: ``entered`` is set when a batch reaches the
    model, which then waits for ``release`` (bounded, so a failing test cannot hang it).
    """

    heavy_preprocess = False

    def __init__(self, fn: Callable[[list[Any]], Sequence[Any]] = echo) -> None:
        self.fn = fn
        self.entered = threading.Event()
        self.release = threading.Event()
        self.batches: list[list[Any]] = []

    def load(self) -> None:
        return None

    def preprocess(self, value: Any) -> list[Prepared]:
        return [Prepared(value)]

    def infer(self, batch: list[Any]) -> Sequence[Any]:
        self.batches.append(list(batch))
        self.entered.set()
        if not self.release.wait(60):
            raise TimeoutError("the test never opened the gate")
        return self.fn(batch)

    def postprocess(self, outputs: list[Any], value: Any) -> Any:
        return outputs[0]


def abort(items: list[Any]) -> list[Any]:
    """Aborts its whole process (SIGABRT, as a crash in native code would) when a batch holds
    "abort"; echoes the rest."""
    _record(items)
    if "abort" in items:
        os.abort()
    return items


def hang(items: list[Any]) -> list[Any]:
    """Never returns (well, after ``BLTEST_HANG_S``, default 600 s) when a batch holds
    "hang"; echoes the rest."""
    _record(items)
    if "hang" in items:
        time.sleep(float(os.environ.get("BLTEST_HANG_S", "600")))
    return items


def double_or_die(items: list[Any]) -> list[Any]:
    """``double``, except that a batch holding "crash" aborts the process and one holding
    "hang" never returns (scripts/chaos.py's hostile inputs)."""
    if "crash" in items:
        os.abort()
    if "hang" in items:
        threading.Event().wait()
    return [x * 2 for x in items]
