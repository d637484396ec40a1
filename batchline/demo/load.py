"""Open-loop load at a fixed rate: requests leave on a schedule, whether or not earlier ones
have been answered (as a web backend's users arrive), unlike a closed loop that waits.

The demo's load steps and ``benchmarks.queue``'s fixed-rate part both send with it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["open_loop"]


async def open_loop(rate: float, count: int, send: Callable[[int], None]) -> float:
    """Call ``send(k)`` for k in 0..count-1, the k-th at ``k / rate`` seconds after the start.

    ``send`` must not block (it starts a task, say): a late call is made at once, never
    skipped, so the offered rate holds on average. Returns the start (``time.perf_counter``).
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    started = time.perf_counter()
    for k in range(count):
        await asyncio.sleep(max(0.0, started + k / rate - time.perf_counter()))
        send(k)
    return started
