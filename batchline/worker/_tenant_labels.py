"""Which tenants get a label of their own in the worker's per-tenant metrics (pure: no I/O).

Prometheus keeps a series per label value, so a label per tenant would grow with the tenants:
at most ``limit`` tenants (``metrics_tenants``) get their own, the busiest by traffic; the
rest count as ``other``, and untenanted traffic as ``-`` (outside the limit). A choice made
by every scrape would make series appear and vanish (a tenant's rate split between its own
series and ``other``), so the choice is sticky:

- traffic is the requests a tenant was served, decayed with a half-life of ``half_life_s``
  (5 minutes): recent traffic counts, yesterday's does not;
- a free label goes to the busiest tenant without one; a tenant keeps its label until it has
  been idle (no request served, none waiting nor in flight) for ``hold_s`` (15 minutes),
  then the label is freed and its series removed;
- a tenant without a label takes the place of the labelled one with the least traffic only
  when its traffic is over ``displace`` (2) times that one's, and that one has held its label
  for ``hold_s`` at least: a label changes hands at most once per ``hold_s``.

Workers choose each on their own, from the queue's counters (the same on every worker) and
what each served: workers that run alike choose alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from batchline.tenants import UNTENANTED

__all__ = ["OTHER", "TenantLabels"]

#: The label of every tenant without one of its own.
OTHER = "other"


@dataclass(slots=True)
class _Seen:
    traffic: float = 0.0  # decayed requests
    active_at: float = 0.0  # last moment it was served, or had requests waiting or in flight
    since: float | None = None  # labelled since (None: counted as other)


class TenantLabels:
    """The tenants with labels of their own (see the module's doc).

    Args:
        limit: most tenants with a label of their own (0: every tenant is ``other``).
        hold_s: how long an idle tenant keeps its label, and the least time a label is
            held before a busier tenant may take it.
        half_life_s: the half-life of the traffic that ranks tenants.
        displace: how many times busier than the least busy labelled tenant one without a
            label must be to take its place.
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        limit: int,
        *,
        hold_s: float = 900.0,
        half_life_s: float = 300.0,
        displace: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit!r}")
        self.limit = limit
        self._hold_s, self._half_life_s, self._displace = hold_s, half_life_s, displace
        self._clock = clock
        self._seen: dict[str, _Seen] = {}
        self._last = clock()

    def label(self, tenant: str | None) -> str:
        """The label ``tenant``'s figures go under: its name, ``-`` (None: untenanted) or
        ``other``."""
        if tenant is None or tenant == UNTENANTED:
            return UNTENANTED
        seen = self._seen.get(tenant)
        return tenant if seen is not None and seen.since is not None else OTHER

    @property
    def chosen(self) -> list[str]:
        """The tenants with a label of their own, by name."""
        return sorted(t for t, s in self._seen.items() if s.since is not None)

    def update(self, served: Mapping[str, float], busy: Iterable[str] = ()) -> list[str]:
        """Take in what each tenant was served since the last update (``served``: requests)
        and which have requests waiting or in flight (``busy``); choose the labels; return
        the tenants whose label was freed (their series to remove)."""
        now = self._clock()
        decay = 0.5 ** (max(0.0, now - self._last) / self._half_life_s)
        self._last = now
        for seen in self._seen.values():
            seen.traffic *= decay
        for tenant, n in served.items():
            if tenant != UNTENANTED and n > 0:
                seen = self._seen.setdefault(tenant, _Seen())
                seen.traffic += n
                seen.active_at = now
        for tenant in busy:
            if tenant != UNTENANTED:
                self._seen.setdefault(tenant, _Seen()).active_at = now
        freed = []
        for tenant, seen in list(self._seen.items()):
            if now - seen.active_at >= self._hold_s:  # idle: its label (if any) freed
                if seen.since is not None:
                    freed.append(tenant)
                del self._seen[tenant]
        self._choose(now, freed)
        return sorted(freed)

    def _choose(self, now: float, freed: list[str]) -> None:
        def rank(tenant: str) -> tuple[float, str]:
            return (-self._seen[tenant].traffic, tenant)

        labelled = [t for t, s in self._seen.items() if s.since is not None]
        waiting = sorted((t for t, s in self._seen.items() if s.since is None), key=rank)
        for tenant in waiting[: max(0, self.limit - len(labelled))]:
            self._seen[tenant].since = now
        waiting = waiting[max(0, self.limit - len(labelled)) :]
        for tenant in waiting:  # the busiest first: each may take the least busy's label
            held = [
                t
                for t, s in self._seen.items()
                if s.since is not None and now - s.since >= self._hold_s
            ]
            if not held:
                return
            weakest = min(held, key=lambda t: (self._seen[t].traffic, t))
            if self._seen[tenant].traffic <= self._displace * self._seen[weakest].traffic:
                return
            self._seen[weakest].since = None
            self._seen[tenant].since = now
            freed.append(weakest)
