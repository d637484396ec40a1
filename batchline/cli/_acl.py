"""``batchline acl``: the ACL SETUSER lines of a queue's producer and worker users; it
connects to nothing."""

from __future__ import annotations

import argparse
from typing import Any

from batchline.cli._options import UsageError, add_option, add_settings, read_settings

__all__ = ["acl_parser", "acl_settings"]

#: ``acl`` needs the queue's names alone.
_SETTINGS = ("queue", "prefix")


def acl_settings(args: argparse.Namespace) -> Any:
    """The settings ``acl`` reads, from its parsed ``args`` and the environment."""
    from batchline.config import ServiceSettings

    return read_settings(ServiceSettings, args)


def _acl(args: argparse.Namespace) -> int:
    from batchline.acl import ROLES, acl_setuser, tenant_setuser
    from batchline.keys import QueueKeys
    from batchline.tenants import is_tenant

    settings = acl_settings(args)
    keys = QueueKeys(settings.queue, settings.prefix)  # the rules cover every priority's stream
    if args.tenant is not None:
        if not is_tenant(args.tenant):
            raise UsageError(
                f"--tenant: 1-64 letters, digits, '_' or '-' (not '-' alone), got {args.tenant!r}"
            )
        if args.batch_api or args.api_keys or args.responses or args.role != "both":
            raise UsageError(
                "--tenant prints one tenant's producer user: not with --role, --batch-api, "
                "--api-keys or --responses"
            )
        print(tenant_setuser(keys, args.tenant))
        return 0
    backend = {"batch_api": args.batch_api, "api_keys": args.api_keys, "responses": args.responses}
    for name, given in backend.items():
        if given and args.role == "worker":
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} adds to the producer user: not with --role worker")
    for role in ROLES if args.role == "both" else (args.role,):
        extra = backend if role == "producer" else {}
        print(acl_setuser(keys, role, user=f"{keys.prefix}-{role}", **extra))
    return 0


def acl_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``acl`` command to the ``batchline`` parser's subcommands ``sub``."""
    from batchline.config import ServiceSettings

    about_acl = "print the ACL SETUSER lines of the producer and worker users (Redis >= 7)"
    acl: argparse.ArgumentParser = sub.add_parser(
        "acl",
        help=about_acl,
        description="Print the ACL SETUSER commands (redis-cli arguments) that create the "
        "queue's producer and worker users, named <prefix>-producer and <prefix>-worker, "
        "each allowed the queue's keys and commands only (Redis >= 7; docs/protocol.md, "
        "Access control). Add each user's password ('>secret') before running them. It "
        "connects to nothing.",
    )
    add_settings(acl, ServiceSettings, _SETTINGS)
    add_option(
        acl,
        "--role",
        choices=["producer", "worker", "both"],
        default="both",
        text="whose line to print: the producer's, the worker's, or both",
        shown="both",
    )
    add_option(
        acl,
        "--batch-api",
        action="store_true",
        text="give the producer user the Batch API's keys too (<prefix>:{batchapi}:*, every "
        "tenant's files, batches and outputs: the web backend keeps tenants apart by their API "
        "keys, Redis does not): for the web backend serving /v1/files and /v1/batches alone",
    )
    add_option(
        acl,
        "--api-keys",
        action="store_true",
        text="give the producer user read access to the tenant store (<prefix>:{tenants}:*, the "
        "API keys' sha256 and the tenants' configs): for a web backend with api_keys on",
    )
    add_option(
        acl,
        "--responses",
        action="store_true",
        text="give the producer user the Responses API's keys too (<prefix>:{responses}:*, "
        "every tenant's stored responses: the web backend keeps tenants apart by their API "
        "keys, Redis does not): for the web backend serving /v1/responses alone",
    )
    add_option(
        acl,
        "--tenant",
        metavar="TENANT",
        default=None,
        text="print instead the producer user of one tenant (<prefix>-tenant-<TENANT>): it "
        "may enqueue, wait for and cancel that tenant's requests only (docs/protocol.md, "
        "Tenants)",
    )
    acl.set_defaults(run=_acl)
    return acl
