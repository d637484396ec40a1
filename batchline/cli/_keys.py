"""``batchline keys``: the HTTP API's keys and the tenants' configs, in the tenant store in
Redis (``create``, ``list``, ``revoke``, ``rotate``, ``set``). A key is printed once, by
``create`` and ``rotate``: the store keeps only its sha256."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from batchline.cli._options import UsageError, add_option, add_settings, read_settings

__all__ = ["keys_parsers", "keys_settings"]

#: ``keys`` reads and writes the tenant store: Redis and the prefix.
_SETTINGS = ("redis_url", "redis_cluster", "prefix", "redis_wait_s")
#: A person typing ``batchline keys`` wants an answer now: one try, unless a wait is set.
_DEFAULTS = {"redis_wait_s": 0.0}
_T = TypeVar("_T")

#: The config options: flag, the TenantConfig field, its type, its metavar, its text.
_CONFIG: tuple[tuple[str, str, Any, str, str], ...] = (
    (
        "--weight",
        "weight",
        float,
        "W",
        "its share of the workers within a priority, against "
        "the other backlogged tenants' weights (> 0)",
    ),
    (
        "--requests-per-min",
        "requests_per_min",
        int,
        "N",
        "requests admitted per minute, per queue (0: no limit)",
    ),
    (
        "--tokens-per-min",
        "tokens_per_min",
        int,
        "N",
        "tokens per minute, per queue: estimated at admission, corrected when known (0: no limit)",
    ),
    (
        "--max-in-flight",
        "max_in_flight",
        int,
        "N",
        "requests admitted and not answered yet, per queue (0: no limit)",
    ),
    (
        "--max-priority",
        "max_priority",
        int,
        "P",
        "the highest priority its requests get (a higher one is lowered to it)",
    ),
    (
        "--over-quota",
        "over_quota",
        str,
        "{refuse,idle}",
        "over a quota: refuse (HTTP 429, "
        "QuotaExceeded), or idle: run it when the workers would otherwise idle, below every "
        "other request",
    ),
)


def keys_settings(args: argparse.Namespace) -> Any:
    """The settings ``keys`` reads, from its parsed ``args`` and the environment."""
    from batchline.config import ServiceSettings

    return read_settings(ServiceSettings, args, _DEFAULTS)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields given as flags (checked now: UsageError naming a bad one)."""
    from batchline.tenants import TenantConfig

    given = {f: getattr(args, f) for _, f, _, _, _ in _CONFIG if getattr(args, f) is not None}
    try:
        TenantConfig(**given)
    except ValueError as exc:
        flag = next((n for n, f, _, _, _ in _CONFIG if str(exc).startswith(f)), None)
        raise UsageError(f"{flag}: {exc}" if flag else str(exc)) from None
    return given


def _tenant(args: argparse.Namespace) -> str:
    from batchline.tenants import check_tenant

    try:
        return check_tenant(args.tenant)
    except ValueError as exc:
        raise UsageError(f"--tenant: {exc}") from None


def _run(args: argparse.Namespace, call: Callable[[Any], Awaitable[_T]]) -> _T:
    """``call(store)`` with the tenant store of the settings' Redis."""
    settings = keys_settings(args)

    async def run() -> _T:
        from batchline.keys import TenantKeys
        from batchline.transport import TenantStore, connect, wait_for_redis

        client = connect(settings)
        try:
            await wait_for_redis(client, settings, wait_s=settings.redis_wait_s)
            return await call(TenantStore(client, TenantKeys(settings.prefix)))
        finally:
            await client.aclose()

    try:
        return asyncio.run(run())
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None


def _config_json(config: Any) -> dict[str, Any]:
    return dict(json.loads(config.to_json()))


def _show_key(key: str, record: Any, config: Any, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"key": key, **_record_json(record), "config": _config_json(config)}))
        return
    print(key)
    print(  # (not on stdout: KEY=$(batchline keys create ...) takes the key alone)
        f"the key is shown once: keep it now (id {record.id}, tenant {record.tenant}"
        f"{', admin' if record.admin else ''}; batchline keys revoke {record.id} ends it)",
        file=sys.stderr,
    )


def _record_json(record: Any) -> dict[str, Any]:
    return {
        "id": record.id,
        "tenant": record.tenant,
        "admin": record.admin,
        "created": record.created,
        "expires": record.expires,
    }


def _create(args: argparse.Namespace) -> int:
    tenant, config = _tenant(args), _config(args)
    key, record, merged = _run(
        args, lambda store: store.create(tenant, admin=args.admin, config=config)
    )
    _show_key(key, record, merged, as_json=args.json)
    return 0


def _set(args: argparse.Namespace) -> int:
    tenant, config = _tenant(args), _config(args)
    if not config:
        raise UsageError(
            "keys set changes a tenant's config: give at least one of "
            + ", ".join(n for n, _, _, _, _ in _CONFIG)
        )
    merged = _run(args, lambda store: store.configure(tenant, config))
    print(json.dumps({"tenant": tenant, "config": _config_json(merged)}))
    return 0


def _revoke(args: argparse.Namespace) -> int:
    key_id = _key_id(args)
    record = _run(args, lambda store: store.revoke(key_id))
    print(f"revoked {record.id} (tenant {record.tenant})")
    return 0


def _rotate(args: argparse.Namespace) -> int:
    key_id = _key_id(args)
    if args.grace_s is not None and not args.grace_s >= 0:
        raise UsageError(f"--grace-s: must be >= 0, got {args.grace_s!r}")

    async def rotate(store: Any) -> None:
        # What the output needs is read first: after the rotation, the new key is the only
        # key (the old one may be revoked already), so it is shown before any other call.
        table = await store.table()
        key, record = await store.rotate(key_id, grace_s=args.grace_s or 0.0)
        _show_key(key, record, table.config(record.tenant), as_json=args.json)

    _run(args, rotate)
    return 0


def _key_id(args: argparse.Namespace) -> str:
    import re

    if not re.fullmatch(r"[0-9a-f]{8}", args.key_id):
        raise UsageError(f"a key id is 8 hex digits (keys list shows them), got {args.key_id!r}")
    return str(args.key_id)


def _list(args: argparse.Namespace) -> int:
    table = _run(args, lambda store: store.table())
    now = time.time()
    records = sorted(
        (r for r in table.keys.values() if r.valid(now)), key=lambda r: (r.tenant, r.created)
    )
    tenants = sorted({r.tenant for r in records} | set(table.configs))
    if args.json:
        print(
            json.dumps(
                {
                    "version": table.version,
                    "keys": [_record_json(r) for r in records],
                    "tenants": {t: _config_json(table.config(t)) for t in tenants},
                },
                indent=2,
            )
        )
        return 0
    if not tenants:
        print("no keys (batchline keys create --tenant NAME makes one)")
        return 0
    print(f"{'ID':<9} {'TENANT':<24} {'ADMIN':<5} {'CREATED (UTC)':<20} EXPIRES")
    for r in records:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.created))
        expires = (
            "-" if r.expires is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.expires))
        )
        print(f"{r.id:<9} {r.tenant:<24} {'yes' if r.admin else 'no':<5} {created:<20} {expires}")
    print()
    print(f"{'TENANT':<24} CONFIG")
    for t in tenants:
        print(f"{t:<24} {table.config(t).to_json()}")
    return 0


def _add_config(parser: argparse.ArgumentParser) -> None:
    for flag, field, kind, metavar, text in _CONFIG:
        if field == "over_quota":
            add_option(parser, flag, dest=field, choices=("refuse", "idle"), text=text)
        else:
            add_option(parser, flag, dest=field, type=kind, metavar=metavar, text=text)


def keys_parsers(sub: Any) -> dict[str, argparse.ArgumentParser]:
    """Add the ``keys`` command to the ``batchline`` parser's subcommands ``sub``; its own
    commands' parsers, by name (``keys create``, ...)."""
    from batchline.config import ServiceSettings

    keys: argparse.ArgumentParser = sub.add_parser(
        "keys",
        help="the HTTP API's keys and the tenants' configs (create, list, revoke, rotate, set)",
        description="Make, list, revoke and rotate the HTTP API's keys, and set tenants' "
        "weights and quotas, in the tenant store in Redis (BATCHLINE_API_KEYS=true on the API "
        "reads it). A key is shown once, when made: only its sha256 is stored.",
    )
    own = keys.add_subparsers(dest="keys_command", required=True, metavar="KEYS_COMMAND")
    made: dict[str, argparse.ArgumentParser] = {}

    def command(name: str, about: str, description: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = own.add_parser(name, help=about, description=description)
        add_settings(parser, ServiceSettings, _SETTINGS, _DEFAULTS)
        made[f"keys {name}"] = parser
        return parser

    create = command(
        "create",
        "a new key for a tenant (printed once)",
        "Make a new API key for a tenant and print it (once: only its hash is kept). The "
        "config flags given set the tenant's weight and quotas (the others keep the values it "
        "has; a new tenant starts with weight 1 and no limits).",
    )
    add_option(
        create,
        "--tenant",
        required=True,
        metavar="NAME",
        text="whose key it is: 1-64 letters, digits, '_' or '-'",
    )
    _add_config(create)
    add_option(
        create,
        "--admin",
        action="store_true",
        text="an admin key: sees and manages every tenant's files, batches and jobs",
    )
    add_option(create, "--json", action="store_true", text="print the key and its record as JSON")
    create.set_defaults(run=_create)

    listing = command(
        "list",
        "the keys (ids, never secrets) and the tenants' configs",
        "List the keys (id, tenant, admin, when made, when a rotated one expires; never a "
        "key) and each tenant's config.",
    )
    add_option(listing, "--json", action="store_true", text="print them as JSON")
    listing.set_defaults(run=_list)

    revoke = command(
        "revoke",
        "revoke a key",
        "Revoke a key by its id: every API replica refuses it within a second.",
    )
    add_option(revoke, "key_id", metavar="ID", text="the key's id (keys list shows it)")
    revoke.set_defaults(run=_revoke)

    rotate = command(
        "rotate",
        "a new key for the same tenant; the old one revoked",
        "Make a new key for the tenant of key ID (the same admin right) and print it once; "
        "revoke the old one, at once or after --grace-s.",
    )
    add_option(rotate, "key_id", metavar="ID", text="the id of the key to replace")
    add_option(
        rotate,
        "--grace-s",
        type=float,
        metavar="SECONDS",
        text="keep the old key valid this long (for clients to move to the new one)",
        shown="0",
    )
    add_option(rotate, "--json", action="store_true", text="print the key and its record as JSON")
    rotate.set_defaults(run=_rotate)

    configure = command(
        "set",
        "change a tenant's weight and quotas",
        "Change a tenant's config (its keys stay): the flags given replace its values; the "
        "workers and the API replicas pick it up within a second or two.",
    )
    add_option(configure, "--tenant", required=True, metavar="NAME", text="the tenant")
    _add_config(configure)
    configure.set_defaults(run=_set)
    return {"keys": keys, **made}
