"""``batchline usage``: requests, items and tokens per tenant per UTC day, summed over the
queues named, as a table, JSON or CSV (enough to bill from)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from batchline.cli._options import UsageError, add_option, add_settings, read_settings

__all__ = ["usage_parser", "usage_settings"]

#: ``usage`` reads the usage counters only: the Redis settings and the queues' names.
_SETTINGS = ("redis_url", "redis_cluster", "prefix", "redis_wait_s")
_DEFAULTS = {"redis_wait_s": 0.0}


def usage_settings(args: argparse.Namespace) -> Any:
    """The settings ``usage`` reads, from its parsed ``args`` and the environment (the
    first ``--queue``, if any, as the queue)."""
    from batchline.config import ServiceSettings

    if args.queues:
        args.queue = args.queues[0]
    return read_settings(ServiceSettings, args, _DEFAULTS)


def _days(args: argparse.Namespace) -> list[str]:
    from batchline.transport.by_tenant import usage_day
    from batchline.transport.usage import days_between

    if args.day and (args.first or args.last):
        raise UsageError("--day or --from/--to, not both")
    today = usage_day(time.time())
    first = args.day or args.first or args.last or today
    last = args.day or args.last or (today if args.first else first)
    try:
        return days_between(first, last)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _usage(args: argparse.Namespace) -> int:
    from batchline.keys import QueueKeys, check_name
    from batchline.tenants import UNTENANTED, check_tenant

    if args.json and args.csv:
        raise UsageError("--json or --csv, not both")
    settings = usage_settings(args)
    days = _days(args)
    try:
        names = [check_name("queue", q) for q in args.queues or [settings.queue]]
        tenant = args.tenant if args.tenant in (None, UNTENANTED) else check_tenant(args.tenant)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    queues = [QueueKeys(name, settings.prefix, settings.priorities) for name in names]

    async def run() -> str:
        from batchline.transport import connect, wait_for_redis
        from batchline.transport.usage import read_usage, totals, usage_csv, usage_table

        client = connect(settings)
        try:
            await wait_for_redis(client, settings, wait_s=settings.redis_wait_s)
            rows = await read_usage(client, queues, days, tenant)
        finally:
            await client.aclose()
        if args.csv:
            return usage_csv(rows).rstrip("\n")
        if args.json:
            shown = {
                "queues": names,
                "from": days[0],
                "to": days[-1],
                "days": [r.as_json() for r in rows],
                "totals": [{**t.as_json(), "day": None} for t in totals(rows)],
            }
            return json.dumps(shown, indent=2)
        return usage_table(rows, days)

    print(asyncio.run(run()))
    return 0


def usage_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``usage`` command to the ``batchline`` parser's subcommands ``sub``."""
    from batchline.config import ServiceSettings

    usage: argparse.ArgumentParser = sub.add_parser(
        "usage",
        help="requests, items and tokens per tenant per day (for billing)",
        description="Print what each tenant used per UTC day: requests answered, items "
        "(texts, pairs) and tokens, and requests refused by a quota, summed over the queues "
        "named, from the usage counters the workers keep (for usage_ttl_days). Untenanted "
        "traffic shows as the tenant '-'. Today by default.",
    )
    add_settings(usage, ServiceSettings, _SETTINGS, _DEFAULTS)
    add_option(
        usage,
        "--queue",
        action="append",
        dest="queues",
        metavar="NAME",
        env="BATCHLINE_QUEUE",
        shown="default",
        text="a queue to count; repeat it to sum over several queues",
    )
    add_option(usage, "--day", metavar="YYYYMMDD", shown="today", text="one UTC day")
    add_option(
        usage, "--from", dest="first", metavar="YYYYMMDD", text="the first UTC day of a range"
    )
    add_option(
        usage,
        "--to",
        dest="last",
        metavar="YYYYMMDD",
        shown="today",
        text="the last UTC day of a range",
    )
    add_option(usage, "--tenant", metavar="NAME", text="only this tenant ('-': untenanted)")
    add_option(
        usage,
        "--json",
        action="store_true",
        text="print JSON: a row per tenant and day, and each tenant's totals over the range",
    )
    add_option(usage, "--csv", action="store_true", text="print CSV: a row per tenant and day")
    usage.set_defaults(run=_usage)
    return usage
