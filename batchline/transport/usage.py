"""``batchline usage``: what each tenant used per UTC day, from the queues' usage counters.

The workers count every answered request in the hash ``usage:<YYYYMMDD>`` of its queue
(docs/protocol.md, Tenants): fields ``<tenant>|requests``, ``<tenant>|items`` and
``<tenant>|tokens``, and the admission ``<tenant>|refused`` (requests refused by a quota);
untenanted traffic counts as the tenant ``-``. A day's hash expires after the workers'
``usage_ttl_days``. This module reads the days asked for, summed over the queues named.
"""

from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from batchline.keys import QueueKeys
from batchline.transport._client import RedisClient
from batchline.transport.by_tenant import USAGE_COUNTERS, parse_usage

__all__ = ["MAX_DAYS", "DayUsage", "days_between", "read_usage", "usage_csv", "usage_table"]

#: The most days one read covers (two years).
MAX_DAYS = 731


@dataclass(frozen=True, slots=True)
class DayUsage:
    """One tenant's use of the queues on one UTC day."""

    day: str
    tenant: str
    requests: int = 0
    items: int = 0
    tokens: int = 0
    refused: int = 0

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _day(text: str) -> datetime:
    try:
        if len(text) != 8 or not text.isdigit():
            raise ValueError(text)
        return datetime.strptime(text, "%Y%m%d").replace(tzinfo=UTC)
    except ValueError:
        raise ValueError(f"a day is YYYYMMDD (UTC), got {text!r}") from None


def days_between(first: str, last: str) -> list[str]:
    """The days from ``first`` to ``last`` (``YYYYMMDD``, both included); ValueError naming
    a malformed day, a range that runs backwards or one over :data:`MAX_DAYS` days."""
    start, end = _day(first), _day(last)
    if end < start:
        raise ValueError(f"the range ends ({last}) before it starts ({first})")
    count = (end - start).days + 1
    if count > MAX_DAYS:
        raise ValueError(f"at most {MAX_DAYS} days at once, got {count} ({first} to {last})")
    return [(start + timedelta(days=i)).strftime("%Y%m%d") for i in range(count)]


async def read_usage(
    client: RedisClient, queues: list[QueueKeys], days: list[str], tenant: str | None = None
) -> list[DayUsage]:
    """Each tenant's counts per day, summed over ``queues`` (only ``tenant``'s, if given);
    days and tenants with nothing counted are left out. By day, then tenant."""
    async with client.pipeline(transaction=False) as pipe:
        for day in days:
            for keys in queues:
                pipe.hgetall(keys.usage(day))
        replies = iter(await pipe.execute())
    rows = []
    for day in days:
        summed: dict[str, dict[str, int]] = {}
        for _keys in queues:
            for name, counts in parse_usage(next(replies)).items():
                if tenant is not None and name != tenant:
                    continue
                into = summed.setdefault(name, dict.fromkeys(USAGE_COUNTERS, 0))
                for counter in USAGE_COUNTERS:
                    into[counter] += counts.get(counter, 0)
        rows += [DayUsage(day, name, **summed[name]) for name in sorted(summed)]
    return rows


def totals(rows: list[DayUsage]) -> list[DayUsage]:
    """Per tenant, its rows summed (``day``: the range, ``first-last``)."""
    by_tenant: dict[str, list[DayUsage]] = {}
    for row in rows:
        by_tenant.setdefault(row.tenant, []).append(row)
    out = []
    for name in sorted(by_tenant):
        mine = by_tenant[name]
        sums = {c: sum(getattr(r, c) for r in mine) for c in USAGE_COUNTERS}
        out.append(DayUsage(f"{mine[0].day}-{mine[-1].day}", name, **sums))
    return out


_COLUMNS = ("day", "tenant", *USAGE_COUNTERS)


def usage_table(rows: list[DayUsage], days: list[str]) -> str:
    """The rows as a table, with each tenant's totals where the range has several days."""
    span = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"
    if not rows:
        return f"no usage counted {'on' if len(days) == 1 else 'from'} {span} (UTC)"
    shown = rows + (totals(rows) if len(days) > 1 else [])
    table = [_COLUMNS] + [tuple(str(getattr(r, c)) for c in _COLUMNS) for r in shown]
    widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
    lines = [f"usage {span} (UTC {'day' if len(days) == 1 else 'days'})"]
    for i, line in enumerate(table):
        if len(days) > 1 and i == len(rows) + 1:
            lines.append("  totals")
        cells = [line[0].ljust(widths[0]), line[1].ljust(widths[1])]
        cells += [v.rjust(w) for v, w in zip(line[2:], widths[2:], strict=True)]
        lines.append("  " + "  ".join(cells))
    return "\n".join(lines)


def usage_csv(rows: list[DayUsage]) -> str:
    """The rows as CSV, a header line first (one row per tenant and day)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(_COLUMNS)
    for row in rows:
        writer.writerow([getattr(row, c) for c in _COLUMNS])
    return out.getvalue()
