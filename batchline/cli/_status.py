"""``batchline status``: a queue's depth, pending requests, lag, dead letters and live
workers, or (``--by-tenant``) each tenant's backlog, in flight and quota use, as text or
JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from batchline.cli._options import add_option, add_settings, read_settings

__all__ = ["status_parser", "status_settings"]

#: ``status`` reads no model and writes nothing: the Redis and queue settings only.
_SETTINGS = ("redis_url", "redis_cluster", "queue", "prefix", "priorities", "redis_wait_s")
#: A person typing ``batchline status`` wants an answer now: one try, unless a wait is set.
_DEFAULTS = {"redis_wait_s": 0.0}


def status_settings(args: argparse.Namespace) -> Any:
    """The settings ``status`` reads, from its parsed ``args`` and the environment."""
    from batchline.config import ServiceSettings

    return read_settings(ServiceSettings, args, _DEFAULTS)


def _status(args: argparse.Namespace) -> int:
    settings = status_settings(args)

    async def run() -> str:
        from batchline.transport import connect, wait_for_redis
        from batchline.transport.by_tenant import render_by_tenant, tenant_figures
        from batchline.transport.status import collect, render

        client = connect(settings)
        try:
            await wait_for_redis(client, settings, wait_s=settings.redis_wait_s)
            if args.by_tenant:
                figures = await tenant_figures(client, settings.keys)
                if args.json:
                    shown = {"queue": settings.queue, "tenants": [f.as_json() for f in figures]}
                    return json.dumps(shown, indent=2)
                return render_by_tenant(settings.queue, figures)
            status = await collect(settings, client)
            return json.dumps(status, indent=2) if args.json else render(status)
        finally:
            await client.aclose()

    print(asyncio.run(run()))
    return 0


def status_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``status`` command to the ``batchline`` parser's subcommands ``sub``."""
    from batchline.config import ServiceSettings

    status: argparse.ArgumentParser = sub.add_parser(
        "status",
        help="queue depth, pending, lag, dead letters, workers",
        description="Print a queue's depth, pending requests, lag, dead letters and live "
        "workers. It tries Redis once, unless --redis-wait-s (or BATCHLINE_REDIS_WAIT_S) "
        "allows a wait.",
    )
    add_settings(status, ServiceSettings, _SETTINGS, _DEFAULTS)
    add_option(
        status,
        "--json",
        action="store_true",
        text="print the figures as JSON (per work stream: length, pending, lag, backlog)",
    )
    add_option(
        status,
        "--by-tenant",
        action="store_true",
        text="per tenant: its weight, backlog per priority, requests in flight, requests and "
        "tokens this minute against its limits, and today's usage",
    )
    status.set_defaults(run=_status)
    return status
