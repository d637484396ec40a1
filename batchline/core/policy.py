"""The batch policy: which waiting items form the next batch, and when.

A pure state machine: no threads, no clocks of its own, no I/O. Drivers (the thread and
asyncio batchers, the Redis worker) add items as they arrive and call :meth:`BatchPolicy.poll`
with the current time whenever the batch function is free; ``poll`` answers with a batch to
run now, the items whose deadline passed, and the time until which the driver may sleep if
nothing new arrives. :meth:`BatchPolicy.add` says whether a sleeping driver must wake up.

Order. Items wait in FIFO lanes, one per (priority, small) pair. Each batch is bound when it
forms, from what waits then, in rank order (:mod:`batchline.core._overtake`, the rule the
generation scheduler shares): an item's rank is the time it was first overtaken (left out of a
batch that arrival order would have put it in, by favoured items or by length grouping), or
the current time if it never was, minus ``max_overtake_s`` per priority level (a "small"
call, one of at most ``small_batch_threshold`` items, counts one level up). So a backlog held
ahead of the function does not delay a favoured item, and no item starves: once overtaken for
``max_overtake_s`` times the level gap, nothing new overtakes it.

Length grouping. With a length per item and more items waiting than fit one batch, the
oldest-ranked item anchors the batch and the rest of it is filled, from a read-ahead window of
``group_window`` batches, with the items whose length is closest to the anchor's. The anchor
is always the head of the queue, so grouping never delays an item beyond the queue ahead of it.

Token budget. With ``max_tokens``, a batch's padded size (rows x longest row) never exceeds
it; an item longer than the budget alone is refused by :meth:`BatchPolicy.check_length`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from batchline.core._overtake import mark_overtaken, rank
from batchline.errors import ItemTooLarge

__all__ = ["BatchPolicy", "Decision", "PolicyConfig", "Waiting"]


class Waiting(Protocol):
    """What the policy needs to know of a waiting item.

    ``queued`` and ``overtaken`` belong to the policy: ``queued`` is True from ``add`` until the
    item leaves in a batch, expires or is found cancelled; ``overtaken`` is when a batch first
    left the item out for items that came after it (``math.inf`` until then). ``cancelled`` is
    read, never written, by the policy.
    """

    arrival: float
    deadline: float | None
    length: int
    priority: int
    small: bool
    queued: bool
    overtaken: float

    @property
    def cancelled(self) -> bool: ...


W = TypeVar("W", bound=Waiting)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Settings of one policy.

    Attributes:
        batch_size: most items in one batch.
        timeout_s: longest the oldest waiting item waits for its batch to fill; 0 dispatches
            whatever waits as soon as the driver polls.
        max_tokens: budget of one batch in padded tokens (rows x longest row), or None.
        max_overtake_s: how long, per level, favoured items (higher priority, or small calls)
            may keep overtaking an item after they first did: the starvation bound.
        group_by_length: fill batches with similar lengths when more items wait than fit.
        group_window: read-ahead for length grouping, in batches.
    """

    batch_size: int = 32
    timeout_s: float = 0.005
    max_tokens: int | None = None
    max_overtake_s: float = 0.1
    group_by_length: bool = False
    group_window: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        if not self.timeout_s >= 0:
            raise ValueError(f"timeout must be >= 0, got {self.timeout_s!r} s")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if not self.max_overtake_s >= 0:
            raise ValueError(f"max_overtake_s must be >= 0, got {self.max_overtake_s!r}")
        if not isinstance(self.group_window, int) or self.group_window < 1:
            raise ValueError(f"group_window must be an int >= 1, got {self.group_window!r}")


@dataclass(slots=True)
class Decision(Generic[W]):
    """The policy's answer to one poll.

    Attributes:
        batch: items to run now, in the order they should be passed (may be empty).
        expired: items whose deadline passed while they waited; they left the queue.
        wake_at: when the driver should poll again if nothing is added (None: only on add).
    """

    batch: list[W]
    expired: list[W]
    wake_at: float | None


class BatchPolicy(Generic[W]):
    """Holds waiting items and hands out batches; see the module docstring."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._lanes: dict[tuple[int, bool], deque[W]] = {}
        self._count = 0
        self._deadlines: list[tuple[float, int, W]] = []
        self._seq = itertools.count()
        self._max_len = 0

    def __len__(self) -> int:
        """Items queued, counting cancelled ones not yet noticed."""
        return self._count

    def check_length(self, length: int) -> None:
        """Raise ItemTooLarge if one item of ``length`` could never fit a batch."""
        budget = self.config.max_tokens
        if budget is not None and length > budget:
            raise ItemTooLarge(
                f"item of length {length} exceeds max_tokens={budget} on its own; "
                "it can never be batched"
            )

    def add(self, item: W) -> bool:
        """Queue ``item``; return True when a sleeping driver must poll again.

        That is when the queue was empty (a new timeout starts), when the queue now holds a
        full batch, or when the item brings the earliest deadline forward.
        """
        cfg = self.config
        key = (item.priority, item.small)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = deque()
        lane.append(item)
        item.queued = True
        self._count += 1
        wake = self._count == 1 or self._count >= cfg.batch_size
        if item.deadline is not None:
            heap = self._deadlines
            if not heap or item.deadline < heap[0][0]:
                wake = True
            heapq.heappush(heap, (item.deadline, next(self._seq), item))
            if len(heap) > 2 * self._count + 64:
                self._compact_deadlines()
        if cfg.max_tokens is not None:
            self._max_len = max(self._max_len, item.length)
            if self._count * self._max_len > cfg.max_tokens:
                wake = True
        return wake

    def poll(self, now: float, *, flush: bool = False, full_only: bool = False) -> Decision[W]:
        """Answer: a batch to run now (maybe empty), expired items, and when to poll again.

        Args:
            now: the current time, on the clock the items' arrival and deadline use.
            flush: dispatch whatever waits without waiting for the timeout (draining).
            full_only: hand out only a full batch (a driver that may start one batch while
                another runs asks this; a partial batch waits for the function to be free).
        """
        expired = self._expire(now)
        oldest = self._oldest_arrival()
        if oldest is None:
            return Decision([], expired, None)
        cfg = self.config
        due = oldest + cfg.timeout_s
        full = self._count >= cfg.batch_size or (
            cfg.max_tokens is not None and self._count * self._max_len > cfg.max_tokens
        )
        if not (flush or full or (now >= due and not full_only)):
            wake_at: float | None = None if full_only else due
            if self._deadlines:
                first = self._deadlines[0][0]
                wake_at = first if wake_at is None else min(wake_at, first)
            return Decision([], expired, wake_at)
        batch = self._form(now)
        if cfg.max_tokens is not None:
            # The running maximum only grows on add; refresh it once the batch has left.
            self._max_len = max(
                (it.length for lane in self._lanes.values() for it in lane if it.queued),
                default=0,
            )
        return Decision(batch, expired, None)

    def drain(self) -> list[W]:
        """Remove and return every live queued item (for closing without running them)."""
        items = [it for lane in self._lanes.values() for it in lane if self._live(it)]
        for lane in self._lanes.values():
            for it in lane:
                it.queued = False  # cancelled ones too: they leave the queue as well
        self._lanes.clear()
        self._deadlines.clear()
        self._count = 0
        self._max_len = 0
        return items

    # -- internals -------------------------------------------------------------------------

    def _live(self, item: W) -> bool:
        return item.queued and not item.cancelled

    def _rank(self, item: W, now: float) -> float:
        level = item.priority + (1 if item.small else 0)
        return rank(item, now, level, self.config.max_overtake_s)

    def _prune(self, lane: deque[W]) -> None:
        """Drop items at the lane's head that expired or were cancelled."""
        while lane:
            head = lane[0]
            if head.queued and not head.cancelled:
                return
            lane.popleft()
            if head.queued:
                head.queued = False
                self._left(1)

    def _left(self, n: int) -> None:
        self._count -= n
        if self._count == 0:
            self._max_len = 0

    def _oldest_arrival(self) -> float | None:
        oldest: float | None = None
        for lane in self._lanes.values():
            self._prune(lane)
            if lane and (oldest is None or lane[0].arrival < oldest):
                oldest = lane[0].arrival
        return oldest

    def _expire(self, now: float) -> list[W]:
        heap = self._deadlines
        expired: list[W] = []
        while heap:
            deadline, _, item = heap[0]
            if item.queued and deadline > now:
                break
            heapq.heappop(heap)
            if item.queued and not item.cancelled:
                expired.append(item)
            if item.queued:
                item.queued = False
                self._left(1)
        return expired

    def _compact_deadlines(self) -> None:
        self._deadlines = [entry for entry in self._deadlines if entry[2].queued]
        heapq.heapify(self._deadlines)

    def _pop_next(self, now: float) -> W | None:
        """Remove and return the live item of lowest rank (then earliest arrival), or None.

        A lane's head ranks lowest in its lane: the items overtaken are the oldest of theirs
        (a prefix of the lane), and those overtaken earlier come first."""
        best: deque[W] | None = None
        best_key = (0.0, 0.0)
        for lane in self._lanes.values():
            self._prune(lane)
            if lane:
                key = (self._rank(lane[0], now), lane[0].arrival)
                if best is None or key < best_key:
                    best, best_key = lane, key
        if best is None:
            return None
        item = best.popleft()
        item.queued = False
        self._left(1)
        return item

    def _take(self, limit: int, now: float) -> list[W]:
        """Pop up to ``limit`` live items in rank order."""
        lanes = [lane for lane in self._lanes.values() if lane]
        if len(lanes) == 1:
            # One lane: FIFO, no rank comparison needed (the common case).
            lane = lanes[0]
            out: list[W] = []
            left = 0
            while lane and len(out) < limit:
                item = lane.popleft()
                if item.queued:
                    item.queued = False
                    left += 1
                    if not item.cancelled:
                        out.append(item)
            self._left(left)
            return out
        out = []
        while len(out) < limit:
            found = self._pop_next(now)
            if found is None:
                break
            out.append(found)
        return out

    def _give_back(self, items: Iterable[W]) -> None:
        """Return items (popped in rank order) to the front of their lanes, in order."""
        back = list(items)
        for item in reversed(back):
            self._lanes[(item.priority, item.small)].appendleft(item)
            item.queued = True
            self._count += 1
        if self.config.max_tokens is not None:  # after: a bad length loses no item
            self._max_len = max([self._max_len, *(item.length for item in back)])

    def _form(self, now: float) -> list[W]:
        batch = self._choose(now)
        if batch and self._count:
            # One lane alone, taken in arrival order, overtakes nothing: no need to look.
            lanes = {key for key, lane in self._lanes.items() if lane}
            lanes.update((it.priority, it.small) for it in batch)
            if len(lanes) > 1:
                self._mark_overtaken(batch, now)
        return batch

    def _choose(self, now: float) -> list[W]:
        cfg = self.config
        size = cfg.batch_size
        select: Callable[[list[W]], list[int]]
        if cfg.group_by_length and (self._count > size or cfg.max_tokens is not None):
            taken, select = self._take(size * cfg.group_window, now), self._group
        elif cfg.max_tokens is None:
            return self._take(size, now)
        else:
            taken, select = self._take(size, now), self._fit
        try:
            chosen = select(taken)
        except BaseException:
            self._give_back(taken)  # nothing is lost: a driver may still drain them
            raise
        picked = set(chosen)
        self._give_back(taken[i] for i in range(len(taken)) if i not in picked)
        return [taken[i] for i in chosen]

    def _fit(self, taken: list[W]) -> list[int]:
        """Token budget, rank order: the items up to the first that does not fit."""
        budget = self.config.max_tokens
        if budget is None:
            return list(range(len(taken)))
        longest = 0
        for i, item in enumerate(taken):
            longest = max(longest, item.length)
            if (i + 1) * longest > budget:
                return list(range(i))
        return list(range(len(taken)))

    def _mark_overtaken(self, batch: list[W], now: float) -> None:
        """Start the clock of the items ``batch`` overtook (the oldest of each lane)."""
        lanes = ((it for it in lane if self._live(it)) for lane in self._lanes.values())
        mark_overtaken(batch, lanes, now)

    def _group(self, window: list[W]) -> list[int]:
        """Length grouping: the window's head and the items closest to its length, in order."""
        cfg = self.config
        if not window:
            return []
        anchor = window[0]
        rest = sorted(range(1, len(window)), key=lambda i: abs(window[i].length - anchor.length))
        chosen = [0]
        longest = anchor.length
        for i in rest:
            if len(chosen) == cfg.batch_size:
                break
            candidate = max(longest, window[i].length)
            if cfg.max_tokens is not None and (len(chosen) + 1) * candidate > cfg.max_tokens:
                continue
            chosen.append(i)
            longest = candidate
        chosen.sort()
        return chosen
