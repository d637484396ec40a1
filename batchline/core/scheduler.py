"""The generation scheduler: which waiting requests join the running batch, and when.

Iteration-level scheduling, pure: no threads, clocks, torch or I/O. Between two decode steps
the driver removes the sequences that finished and calls :meth:`GenerationScheduler.admit`
with the clock and the sequences still running; the answer names the waiting requests to
prefill now, those whose deadline passed and those found cancelled.

Budgets. At most ``max_batch_size`` sequences run at once, and the KV cache they may grow to
stays within ``max_batch_tokens``. A sequence reserves ``prompt_tokens + max_new_tokens`` when
it joins: the most KV cache it can ever hold. The engine keeps one left-padded cache, as wide
as its longest row, so what a batch may grow to is counted as the engine lays it out: rows x
the longest reservation (:func:`footprint`), not the sum of the reservations. A long prompt
therefore widens every row beside it; when it does not fit it waits (see Order) rather than
multiplying the cache. Reserving the worst case (rather than counting prompt + generated so
far) means an admitted sequence never has to be evicted or preempted to make room for
another's growth, so every admitted request runs to its end without recomputation; the cost
is some idle budget while long ``max_new_tokens`` sequences are young. A request whose
reservation alone exceeds ``max_batch_tokens`` can never fit:
:meth:`GenerationScheduler.add` refuses it at once with :class:`~batchline.errors.PromptTooLong`.

Order. As in :mod:`batchline.core.policy` (the same rule, :mod:`batchline.core._overtake`), a
request's *rank* is the time it was first overtaken (left out of an admission that arrival
order would have put it in), or the current time if it never was, minus ``max_overtake_s``
per priority level; admission goes in rank order. So a higher-priority request joins before
every waiting one no favoured request has overtaken yet, and one overtaken for
``max_overtake_s`` per level is overtaken no more. When the best-ranked
request does not fit the room left, smaller requests behind it may backfill that room, but only
while the blocked request has waited less than ``max_backfill_s``; after that nothing joins
before it, the running sequences drain, and it is admitted. So a long prompt is delayed by
backfill for a bounded time and never starves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from batchline.core._overtake import mark_overtaken, rank
from batchline.errors import PromptTooLong

__all__ = [
    "GenerationScheduler",
    "SchedulerConfig",
    "Sequenced",
    "StepAdmission",
    "footprint",
    "reservation",
]


class Sequenced(Protocol):
    """What the scheduler needs to know of a generation request (waiting or running)."""

    @property
    def arrival(self) -> float: ...
    @property
    def deadline(self) -> float | None: ...
    @property
    def priority(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def max_new_tokens(self) -> int: ...
    @property
    def cancelled(self) -> bool: ...

    #: The scheduler's: when an admission first left it out (``math.inf`` until then).
    overtaken: float


S = TypeVar("S", bound=Sequenced)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Settings of one generation scheduler.

    Attributes:
        max_batch_size: most sequences running at once.
        max_batch_tokens: KV budget, in tokens: running sequences x the longest of their
            reservations (``prompt_tokens + max_new_tokens``), as the engine's left-padded
            cache lays them out.
        max_overtake_s: how long a higher-priority request may jump ahead per level.
        max_backfill_s: how long smaller requests may join ahead of a best-ranked request
            that does not fit yet: the starvation bound for long prompts.
    """

    max_batch_size: int = 32
    max_batch_tokens: int = 16384
    max_overtake_s: float = 0.1
    max_backfill_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batch_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("max_overtake_s", "max_backfill_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(slots=True)
class StepAdmission(Generic[S]):
    """The scheduler's answer to one :meth:`GenerationScheduler.admit`: which sequences
    join the next generation step (not a request's way into a Redis queue, which is
    :mod:`batchline.transport._admission`).

    Attributes:
        admit: requests to prefill now, best rank first; they left the waiting set.
        expired: waiting requests whose deadline passed; they left the waiting set.
        cancelled: waiting requests found cancelled; they left the waiting set.
    """

    admit: list[S]
    expired: list[S]
    cancelled: list[S]


def reservation(item: Sequenced) -> int:
    """KV tokens a sequence reserves: its prompt plus everything it may still generate."""
    return item.prompt_tokens + item.max_new_tokens


def footprint(items: Sequence[Sequenced]) -> int:
    """KV tokens a batch may grow to in one left-padded cache: rows x the longest
    reservation (a row is as wide as the widest)."""
    return len(items) * max((reservation(it) for it in items), default=0)


class GenerationScheduler(Generic[S]):
    """Holds waiting generation requests and admits them; see the module docstring."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._waiting: list[S] = []

    def __len__(self) -> int:
        """Requests waiting."""
        return len(self._waiting)

    def check(self, item: Sequenced) -> None:
        """Raise :class:`PromptTooLong` if ``item`` could never be admitted."""
        need = reservation(item)
        if need > self.config.max_batch_tokens:
            raise PromptTooLong(
                f"prompt of {item.prompt_tokens} tokens + max_new_tokens "
                f"{item.max_new_tokens} = {need} exceeds max_batch_tokens "
                f"{self.config.max_batch_tokens}"
            )

    def add(self, item: S) -> None:
        """Queue ``item``; raises :class:`PromptTooLong` at once if it can never fit."""
        self.check(item)
        self._waiting.append(item)

    def drain(self) -> list[S]:
        """Remove and return everything waiting (on shutdown)."""
        items, self._waiting = self._waiting, []
        return items

    def rank(self, item: Sequenced, now: float) -> float:
        """When it was first overtaken (else ``now``) less the overtaking credit of its
        priority: lower goes first."""
        return rank(item, now, item.priority, self.config.max_overtake_s)

    def admit(self, now: float, running: Sequence[Sequenced]) -> StepAdmission[S]:
        """Which waiting requests join now, given the sequences still running."""
        expired: list[S] = []
        cancelled: list[S] = []
        live: list[S] = []
        for item in self._waiting:
            if item.cancelled:
                cancelled.append(item)
            elif item.deadline is not None and item.deadline <= now:
                expired.append(item)
            else:
                live.append(item)
        live.sort(key=lambda it: (self.rank(it, now), it.arrival))
        slots = self.config.max_batch_size - len(running)
        rows = len(running)
        widest = max((reservation(it) for it in running), default=0)
        admit: list[S] = []
        keep: list[S] = []
        blocked = False
        for item in live:
            need = reservation(item)
            fits = (rows + 1) * max(widest, need) <= self.config.max_batch_tokens
            if slots > 0 and fits and not blocked:
                admit.append(item)
                slots -= 1
                rows += 1
                widest = max(widest, need)
                continue
            keep.append(item)
            if not blocked and now - item.arrival >= self.config.max_backfill_s:
                blocked = True  # it has waited long enough: nothing more jumps it
        self._waiting = keep
        if admit and keep:
            mark_overtaken(admit, [sorted(keep, key=lambda it: it.arrival)], now)
        return StepAdmission(admit, expired, cancelled)
