"""Where a plain (not async) batch function runs under asyncio: on its thread, or inline.

A plain function normally runs on a thread of the batcher's own, so that the event loop stays
free while it computes. Handing a batch to that thread and back costs tens of microseconds of
CPU and a round trip of the GIL, which is more than a function that returns in a few
microseconds costs itself. :class:`Pace` watches how long the function's calls take and says
when to run it on the loop itself instead: after ``streak`` calls in a row each shorter than
``inline_below_s``. One call at or over that time sends it back to the thread for at least
``streak`` calls, so the loop is never held by more than one slow call after a run of quick
ones. Pure: the driver measures and asks.
"""

from __future__ import annotations

__all__ = ["Pace"]


class Pace:
    """Counts quick calls in a row; ``inline`` once there were ``streak`` of them.

    Args:
        inline_below_s: a call shorter than this is quick (0: never run inline).
        streak: quick calls in a row before running inline.
    """

    __slots__ = ("_quick", "inline_below_s", "streak")

    def __init__(self, inline_below_s: float = 2e-4, streak: int = 16) -> None:
        if not inline_below_s >= 0:
            raise ValueError(f"inline_below_s must be >= 0, got {inline_below_s!r}")
        if streak < 1:
            raise ValueError(f"streak must be >= 1, got {streak!r}")
        self.inline_below_s = inline_below_s
        self.streak = streak
        self._quick = 0

    @property
    def inline(self) -> bool:
        """Run the next call on the loop?"""
        return self._quick >= self.streak

    def observe(self, seconds: float) -> None:
        """Record how long one call of the function took."""
        if seconds < self.inline_below_s:
            self._quick += 1
        else:
            self._quick = 0
