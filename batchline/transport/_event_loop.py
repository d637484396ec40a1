"""The service's event loop: uvloop where it is installed (the ``fast`` extra), else asyncio's.

uvloop (libuv underneath, the transports in Cython) runs the same asyncio programs with less
CPU per callback and per socket read, which is most of what the no-op service path costs in
the worker and the producer. The ``event_loop`` setting picks: ``auto`` (uvloop if it
imports), ``uvloop`` (an error without it) or ``asyncio``.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["EXIT_INTERRUPTED", "loop_factory", "run_loop"]

T = TypeVar("T")

#: The exit status of every ``batchline`` command stopped by Ctrl-C (SIGINT): the shell's
#: 128 + 2, after the command has cleaned up (a worker drained, the demo's processes stopped).
EXIT_INTERRUPTED = 128 + signal.SIGINT


def loop_factory(name: str = "auto") -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes a new event loop of the kind ``name`` (``auto``, ``uvloop``, ``asyncio``)."""
    if name not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"event_loop must be auto, uvloop or asyncio; got {name!r}")
    if name != "asyncio":
        try:
            import uvloop
        except ImportError:
            if name == "uvloop":
                raise ValueError(
                    "event_loop=uvloop needs the package uvloop: pip install 'batchline[fast]'"
                ) from None
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def run_loop(main: Coroutine[Any, Any, T], *, event_loop: str = "auto") -> T:
    """``asyncio.run(main)`` on a loop of the kind ``event_loop``."""
    with asyncio.Runner(loop_factory=loop_factory(event_loop)) as runner:
        return runner.run(main)
