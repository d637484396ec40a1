"""Model calls of the queues one worker process serves, one at a time, in the order they
are ready (``batchline worker --serve``): while one queue's batch (a generation step) runs,
another queue's waits at most for it, and for one call of each queue that was ready first.
The models share the device (its cores, or its GPU); calls that ran at once would
oversubscribe it, and a queue that called without pause would keep the others waiting."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["Turns"]


class Turns:
    """A first-come, first-served lock over threads (a ticket lock): :meth:`turn` waits
    until every call that asked before it has run."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._issued = 0  # tickets handed out
        self._serving = 0  # the ticket whose call may run
        #: Calls that waited for another's turn (the interleaving, for the statistics).
        self.waited = 0

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Within this block, this call alone runs."""
        with self._changed:
            ticket = self._issued
            self._issued += 1
            if ticket != self._serving:
                self.waited += 1
            while ticket != self._serving:
                self._changed.wait()
        try:
            yield
        finally:
            with self._changed:
                self._serving += 1
                self._changed.notify_all()
