"""Running one batch with failure isolation, without doing any I/O.

A driver asks :meth:`Isolation.next` for the items to pass to the batch function, calls the
function (synchronously, in a thread, or awaiting it: that is the driver's business) and
reports the outcome with :meth:`Isolation.succeeded` or :meth:`Isolation.failed`, until
``next`` returns None. Every item is settled by then: resolved with its own output, or
rejected with an error. The rules live here, once, for every driver:

- an exception from the function is isolated: the batch is split in halves and each half is
  retried, down to single items, so one bad item fails only its own caller (``isolate=False``
  fails the whole batch at once instead);
- a result of the wrong length (or no sequence at all) rejects every item of that call with a
  BatchFunctionError, since no output can be matched to its input; so does a
  BatchFunctionError raised by a wrapper around the function (a broken contract is not an
  item's fault, and is not retried);
- a BaseException that is not an Exception (SystemExit, KeyboardInterrupt raised inside the
  function) is not retried: it rejects the items with a BatchFunctionError chained to it, and
  the driver carries on;
- items whose caller went away (cancelled, timed out) are dropped before each call.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from batchline.errors import BatchFunctionError

__all__ = ["Isolation", "Settleable"]

logger = logging.getLogger(__name__)


class Settleable(Protocol):
    """An item the isolation can settle."""

    payload: Any

    @property
    def cancelled(self) -> bool: ...

    def resolve(self, value: Any) -> None: ...

    def reject(self, exc: BaseException) -> None: ...


S = TypeVar("S", bound=Settleable)


class Isolation(Generic[S]):
    """One batch's run; see the module docstring.

    Attributes:
        durations_s: how long each call of the batch function took.
    """

    def __init__(self, items: list[S], *, isolate: bool = True) -> None:
        self._pending: list[list[S]] = [items]
        self._isolate = isolate
        self._current: list[S] = []
        self._started = 0.0
        self.durations_s: list[float] = []

    def next(self) -> list[Any] | None:
        """The payloads for the next call of the batch function, or None when all is settled."""
        while self._pending:
            sub = [item for item in self._pending.pop() if not item.cancelled]
            if sub:
                self._current = sub
                self._started = time.monotonic()
                return [item.payload for item in sub]
        return None

    @property
    def exhausted(self) -> bool:
        """True when ``next`` has nothing more to give (no retries pending)."""
        return not self._pending

    def succeeded(self, outputs: Any) -> None:
        """The function returned ``outputs`` for the payloads ``next`` gave."""
        self.settle_later(outputs)()

    def settle_later(self, outputs: Any) -> Callable[[], None]:
        """Like ``succeeded``, but only record the call's duration now; the function it returns
        settles the items, on any thread, while this run goes on (items of a call may be
        settled from two threads: ``Call`` makes that safe)."""
        self._timed()
        sub = self._current
        return functools.partial(self._settle, sub, outputs)

    @classmethod
    def _settle(cls, sub: list[S], outputs: Any) -> None:
        try:
            count = len(outputs)
            if not isinstance(outputs, Sequence):
                outputs = list(outputs)  # sized but maybe not iterable: must not escape
        except Exception as exc:  # not sized, or its len/iteration raised
            error = BatchFunctionError(
                f"the batch function returned {type(outputs).__name__}, "
                f"not a sequence of {len(sub)} results"
            )
            error.__cause__ = exc
            cls._reject(sub, error)
            return
        if count != len(sub) or len(outputs) != count:
            cls._reject(
                sub,
                BatchFunctionError(
                    f"the batch function returned {count} results for {len(sub)} inputs"
                ),
            )
            return
        for item, output in zip(sub, outputs, strict=True):
            try:
                item.resolve(output)
            except Exception as exc:  # a waker failed: reject this item, settle the rest
                logger.exception("batchline: settling an item failed")
                item.reject(exc)

    def failed(self, exc: BaseException) -> None:
        """The function raised ``exc`` for the payloads ``next`` gave."""
        self._timed()
        sub = self._current
        if not isinstance(exc, Exception):
            error = BatchFunctionError(f"the batch function raised {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._reject(sub, error)
            return
        if self._isolate and len(sub) > 1 and not isinstance(exc, BatchFunctionError):
            half = len(sub) // 2
            # Pushed second half first so that the first half runs first.
            self._pending.append(sub[half:])
            self._pending.append(sub[:half])
            return
        self._reject(sub, exc)

    def abort(self, exc: BaseException) -> None:
        """Reject everything not settled yet (the driver is shutting down mid-batch)."""
        self._reject(self._current, exc)
        while self._pending:
            self._reject(self._pending.pop(), exc)

    def _timed(self) -> None:
        self.durations_s.append(time.monotonic() - self._started)

    @staticmethod
    def _reject(items: list[S], exc: BaseException) -> None:
        for item in items:
            item.reject(exc)
