"""What a queue holds and uses per tenant: ``batchline status --by-tenant`` and the worker's
per-tenant metrics read it from the queue's keys (docs/protocol.md, Tenants).

The tenants shown are those the queue knows of: configured (its ``tenants`` hash), backlogged
at some priority (``fair:<p>``, and ``fair:<p>:idle`` for requests held over quota), or
served today (the ``usage:<day>`` hash). Per tenant:

- ``backlog``: per priority, requests admitted and held for the fair share, not yet in a work
  stream (``bl:<tenant>:<p>``; with ``over_quota: idle``, its requests held over quota,
  ``bl:<tenant>~over:<p>``, count too and show apart as ``over_quota``);
- ``in_flight``: requests admitted and not answered (``inflight:<tenant>``, entries not past
  their expiry);
- ``requests_this_minute`` / ``tokens_this_minute``: what its quotas counted in the current
  minute (``quota:<tenant>:r|t:<minute>``), against ``requests_per_min`` / ``tokens_per_min``;
- ``requests_today`` / ``tokens_today`` / ``refused_today``: the usage counters of the UTC day;
- ``config``: its weight and limits (absent: weight 1, no limits).

Untenanted traffic appears as the tenant ``-`` where the queue counted it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from batchline.keys import QueueKeys
from batchline.tenants import TenantConfig, over_quota_name, split_held
from batchline.transport._client import RedisClient
from batchline.transport._quota import usage_day

__all__ = [
    "USAGE_COUNTERS",
    "TenantFigures",
    "parse_usage",
    "render_by_tenant",
    "tenant_figures",
    "usage_day",
]

logger = logging.getLogger(__name__)

#: The counters a tenant's day holds in ``usage:<day>`` (field ``<tenant>|<counter>``).
USAGE_COUNTERS = ("requests", "items", "tokens", "refused")


@dataclass(slots=True)
class TenantFigures:
    """One tenant's figures on one queue (see the module's doc)."""

    tenant: str
    backlog: dict[int, int] = field(default_factory=dict)
    over_quota: dict[int, int] = field(default_factory=dict)
    in_flight: int = 0
    requests_this_minute: int = 0
    tokens_this_minute: int = 0
    requests_today: int = 0
    tokens_today: int = 0
    refused_today: int = 0
    config: TenantConfig = field(default_factory=TenantConfig)
    configured: bool = False

    @property
    def queued(self) -> int:
        """Requests held in its backlogs, all priorities."""
        return sum(self.backlog.values())

    def as_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "tenant": self.tenant,
            "backlog": {str(p): n for p, n in sorted(self.backlog.items(), reverse=True)},
            "over_quota": {str(p): n for p, n in sorted(self.over_quota.items(), reverse=True)},
            "queued": self.queued,
            "in_flight": self.in_flight,
            "requests_this_minute": self.requests_this_minute,
            "tokens_this_minute": self.tokens_this_minute,
            "requests_today": self.requests_today,
            "tokens_today": self.tokens_today,
            "refused_today": self.refused_today,
            "configured": self.configured,
            "weight": c.weight,
            "requests_per_min": c.requests_per_min,
            "tokens_per_min": c.tokens_per_min,
            "max_in_flight": c.max_in_flight,
            "max_priority": c.max_priority,
            "over_quota_mode": c.over_quota,
        }


def parse_usage(raw: dict[Any, Any]) -> dict[str, dict[str, int]]:
    """A ``usage:<day>`` hash as ``{tenant: {counter: n}}`` (fields ``<tenant>|<counter>``;
    a field of another shape, or a count that is not an integer, is skipped)."""
    out: dict[str, dict[str, int]] = {}
    for name, value in raw.items():
        tenant, bar, counter = _text(name).rpartition("|")
        if not bar or not tenant:
            continue
        try:
            count = int(value)
        except ValueError:
            continue
        out.setdefault(tenant, {})[counter] = count
    return out


async def tenant_figures(
    client: RedisClient, keys: QueueKeys, *, now: float | None = None
) -> list[TenantFigures]:
    """Every tenant the queue knows of, with its figures, by name (``-`` first)."""
    now = time.time() if now is None else now
    async with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.tenants)
        pipe.hgetall(keys.usage(usage_day(now)))
        for priority in range(keys.priorities):
            pipe.zrange(keys.fair(priority), 0, -1)
            pipe.zrange(keys.fair_idle(priority), 0, -1)
        configs, usage, *sets = await pipe.execute()
    fair = [sets[i] + sets[i + 1] for i in range(0, len(sets), 2)]  # per priority
    figures: dict[str, TenantFigures] = {}

    def of(tenant: str) -> TenantFigures:
        return figures.setdefault(tenant, TenantFigures(tenant))

    for name, raw in configs.items():
        tenant = of(_text(name))
        try:
            tenant.config, tenant.configured = TenantConfig.from_json(raw), True
        except ValueError as exc:  # shown with defaults; the mirror writes valid ones
            logger.warning("tenant %s: its config is unreadable: %s", tenant.tenant, exc)
    for name, counts in parse_usage(usage).items():
        tenant = of(name)
        tenant.requests_today = counts.get("requests", 0)
        tenant.tokens_today = counts.get("tokens", 0)
        tenant.refused_today = counts.get("refused", 0)
    held = [[split_held(_text(m)) for m in members] for members in fair]
    for members in held:
        for name, _over in members:
            of(name)
    await _read_counts(client, keys, figures, held, now)
    return sorted(figures.values(), key=lambda f: (f.tenant != "-", f.tenant))


async def _read_counts(
    client: RedisClient,
    keys: QueueKeys,
    figures: dict[str, TenantFigures],
    held: list[list[tuple[str, bool]]],
    now: float,
) -> None:
    """In one pipeline: the backlogs of the tenants backlogged at each priority (``held``,
    from ``fair:<p>`` and ``fair:<p>:idle``: no other tenant holds requests there), each
    tenant's in-flight count, and this minute's quota counters where the tenant has that
    limit (none are kept otherwise)."""
    minute = int(now // 60)
    names = list(figures)
    async with client.pipeline(transaction=False) as pipe:
        for priority, members in enumerate(held):
            for name, over in members:
                pipe.llen(keys.backlog(over_quota_name(name) if over else name, priority))
        for name in names:
            pipe.zcount(keys.tenant_in_flight(name), f"({int(now * 1000)}", "+inf")
            if figures[name].config.requests_per_min:
                pipe.get(keys.quota(name, "r", minute))
            if figures[name].config.tokens_per_min:
                pipe.get(keys.quota(name, "t", minute))
        replies = iter(await pipe.execute())
    for priority, members in enumerate(held):
        for name, over in members:
            n, tenant = int(next(replies)), figures[name]
            if n:
                tenant.backlog[priority] = tenant.backlog.get(priority, 0) + n
            if n and over:
                tenant.over_quota[priority] = n
    for name in names:
        tenant = figures[name]
        tenant.in_flight = int(next(replies))
        if tenant.config.requests_per_min:
            tenant.requests_this_minute = int(next(replies) or 0)
        if tenant.config.tokens_per_min:
            tenant.tokens_this_minute = int(next(replies) or 0)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _limit(used: int, limit: int) -> str:
    return f"{used}/{limit}" if limit else f"{used}/-"


def render_by_tenant(queue: str, figures: list[TenantFigures]) -> str:
    """The figures as a table: a row per tenant (``-`` limits: none)."""
    if not figures:
        return f"queue {queue}: no tenants (none configured, backlogged or served today)"
    header = ("tenant", "weight", "backlog by priority", "in flight", "rpm", "tpm", "today")
    rows = [header]
    for f in figures:
        c = f.config
        backlog = " ".join(
            f"p{p}:{n}" + (f" ({f.over_quota[p]} over quota)" if f.over_quota.get(p) else "")
            for p, n in sorted(f.backlog.items(), reverse=True)
        )
        rows.append(
            (
                f.tenant,
                f"{c.weight:g}",
                backlog or "0",
                _limit(f.in_flight, c.max_in_flight),
                _limit(f.requests_this_minute, c.requests_per_min),
                _limit(f.tokens_this_minute, c.tokens_per_min),
                f"{f.requests_today} req, {f.tokens_today} tok"
                + (f", {f.refused_today} refused" if f.refused_today else ""),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"queue {queue}, per tenant (used/limit this minute; -: no limit)"]
    for row in rows:
        lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    return "\n".join(line.rstrip() for line in lines)
