"""The order both batching cores take waiting items in: who may overtake whom, and for how
long (:mod:`batchline.core.policy` forming batches, :mod:`batchline.core.scheduler`
admitting generation requests).

An item's *rank* is the time it was first overtaken, or the current time if it never was,
less ``max_overtake_s`` per priority level; lower goes first, equal ranks by arrival. An item
is *overtaken* when the items taken leave it out where taking the same number in arrival order
would have included it. So a favoured item goes before every item no favoured one has
overtaken yet, however long that item has waited behind its own level, and once an item has
been overtaken for ``max_overtake_s`` per level, nothing new overtakes it: no starvation.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from typing import Protocol

__all__ = ["Overtakable", "mark_overtaken", "rank"]


class Overtakable(Protocol):
    """What the order needs of a waiting item; ``overtaken`` belongs to the core that
    orders it (``math.inf`` until the item is first overtaken)."""

    @property
    def arrival(self) -> float: ...

    overtaken: float


def rank(item: Overtakable, now: float, level: int, credit_s: float) -> float:
    """``item``'s rank at ``now`` at priority ``level`` (``credit_s`` a level): lower first."""
    return min(item.overtaken, now) - level * credit_s


def mark_overtaken(
    taken: Iterable[Overtakable], waiting: Iterable[Iterable[Overtakable]], now: float
) -> None:
    """Start the clock (at ``now``) of the items ``taken`` overtook: of the items left
    ``waiting`` (groups, each in arrival order), those that the same number taken in arrival
    order would have included (ties go to the items taken)."""
    chosen = sorted((it.arrival, None) for it in taken)
    n = len(chosen)
    if not n:
        return
    groups = [[(it.arrival, it) for it in itertools.islice(group, n)] for group in waiting]
    entries: Iterable[tuple[float, Overtakable | None]] = heapq.merge(chosen, *groups, key=_first)
    for _, item in itertools.islice(entries, n):
        if item is not None and item.overtaken > now:
            item.overtaken = now


def _first(entry: tuple[float, object]) -> float:
    return entry[0]
