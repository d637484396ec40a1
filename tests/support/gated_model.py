"""A ``module:callable`` model whose load waits for a file (``BLTEST_LOAD_GATE``), for tests
of models loaded by demand: the worker's load resolves ``slow_to_load`` here, and this
module's ``__getattr__`` (called on each resolve: the name is not a module attribute) holds
it until the file exists; ``fails_until_gate`` fails at once until it exists. The function
echoes its inputs."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

__all__: list[str] = []


def _echo(items: list[Any]) -> list[Any]:
    return items


def __getattr__(name: str) -> Any:
    if name == "times_out":  # a load that fails at once with a TimeoutError of its own
        raise TimeoutError("the weights' host timed out")
    if name == "fails_until_gate":  # a load that fails at once while the file is not there
        gate = os.environ.get("BLTEST_LOAD_GATE")
        if not gate or not Path(gate).exists():
            raise FileNotFoundError(f"no weights at {gate}")
        return _echo
    if name != "slow_to_load":
        raise AttributeError(name)
    gate = os.environ.get("BLTEST_LOAD_GATE")
    while gate and not Path(gate).exists():  # held until the test opens the gate
        time.sleep(0.02)
    return _echo
