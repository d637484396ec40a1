"""The tenant store: the HTTP API's keys and the tenants' configs, in Redis, shared by every
API replica and mirrored by the workers (docs/protocol.md, Tenants; key names:
:class:`batchline.keys.TenantKeys`).

- ``<prefix>:{tenants}:keys``, a hash: the sha256 (hex) of a key -> its record, JSON
  ``{"id", "tenant", "admin", "created"}`` (and ``"expires"``, unix seconds, for a key
  rotated with a grace period). The key itself is never stored: it is shown once, when made.
- ``<prefix>:{tenants}:config``, a hash: tenant -> :meth:`TenantConfig.to_json`.
- ``<prefix>:{tenants}:version``, an integer every change moves (``INCR``, in the same
  ``MULTI`` as the change): a reader that saw version v and reads v again has nothing to
  reload.
- ``<prefix>:{tenants}:changes``, a stream capped at about :data:`CHANGES_KEPT` entries: each
  change appends ``version`` (the one it made) and ``revoked`` (the sha256 of each key it
  revoked, space-separated; empty: none), in the same ``MULTI``. The API replicas wait on it
  (``XREAD BLOCK``), so a revoke reaches them as it is made, not at their next look at the
  version (:func:`read_changes`).

A key reads ``bl-<id>-<secret>``: ``id`` 8 hex digits, public (``keys list``, logs), and
``secret`` 32 random bytes from :mod:`secrets` in base64url (43 characters).
Every change is one ``MULTI`` watched on ``version`` (the one key every writer moves), retried
when another writer got there first. Readers take no lock: :func:`read_table` reads the
version first, so a change made while it reads moves the version past what it returns.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from redis.exceptions import WatchError

from batchline.keys import TenantKeys
from batchline.tenants import TenantConfig, check_tenant
from batchline.transport._blocking import block_ms as bounded
from batchline.transport._client import RedisClient, RedisPipeline

__all__ = [
    "CHANGES_KEPT",
    "KEY_PATTERN",
    "KeyRecord",
    "StoreChange",
    "TenantStore",
    "TenantTable",
    "key_hash",
    "key_id_of",
    "last_change_id",
    "new_key",
    "read_changes",
    "read_table",
    "read_version",
]

logger = logging.getLogger(__name__)

#: Every key the store makes: ``bl-``, the public id, ``-``, the secret.
KEY_PATTERN = re.compile(r"bl-([0-9a-f]{8})-[A-Za-z0-9_-]{43}")
_ID = re.compile(r"[0-9a-f]{8}")
#: About how many changes the store's log keeps (``XADD MAXLEN ~``): a reader that missed more
#: (cut off from Redis a long while) reads the whole store again, as it would anyway.
CHANGES_KEPT = 1000
_T = TypeVar("_T")


def new_key() -> tuple[str, str]:
    """A new key and its public id: ``(key, id)``."""
    key_id = secrets.token_hex(4)
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()
    return f"bl-{key_id}-{secret}", key_id


def key_hash(key: str) -> str:
    """What the store holds of a key: its sha256, hex."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def key_id_of(key: str) -> str | None:
    """The public id of a key of the store's form, else None (never the key)."""
    match = KEY_PATTERN.fullmatch(key)
    return match.group(1) if match else None


def _check_id(key_id: object) -> str:
    if not isinstance(key_id, str) or not _ID.fullmatch(key_id):
        raise ValueError(f"a key id is 8 hex digits (as keys list shows), got {key_id!r}")
    return key_id


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """What the store knows of a key (never the key).

    Attributes:
        id: its public id (8 hex digits, also in the key).
        tenant: whose key it is.
        admin: sees and manages every tenant's files, batches and jobs.
        created: when it was made (unix seconds).
        expires: when it stops being valid (unix seconds; a key rotated with a grace
            period), None: until revoked.
    """

    id: str
    tenant: str
    admin: bool = False
    created: int = 0
    expires: float | None = None

    def valid(self, now: float) -> bool:
        """Whether the key is valid at ``now`` (unix seconds)."""
        return self.expires is None or now < self.expires

    def to_json(self) -> str:
        """The record as the store holds it."""
        out: dict[str, Any] = {
            "id": self.id,
            "tenant": self.tenant,
            "admin": self.admin,
            "created": self.created,
        }
        if self.expires is not None:
            out["expires"] = self.expires
        return json.dumps(out, separators=(",", ":"))

    @classmethod
    def from_json(cls, data: str | bytes) -> KeyRecord:
        """Read :meth:`to_json`'s output (unknown fields ignored); ValueError otherwise."""
        try:
            raw: Any = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"a key's record is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("a key's record must be a JSON object")
        admin, created, expires = raw.get("admin", False), raw.get("created", 0), raw.get("expires")
        if not isinstance(admin, bool) or not isinstance(created, int | float):
            raise ValueError("a key's record has a bad admin or created field")
        if expires is not None and (
            isinstance(expires, bool) or not isinstance(expires, int | float)
        ):
            raise ValueError("a key's record has a bad expires field")
        return cls(
            id=_check_id(raw.get("id")),
            tenant=check_tenant(raw.get("tenant")),
            admin=admin,
            created=int(created),
            expires=None if expires is None else float(expires),
        )


@dataclass(frozen=True, slots=True)
class TenantTable:
    """The whole store as read at one version.

    Attributes:
        version: the store's version when read (0: nothing was ever written).
        keys: each key's sha256 (hex) -> its record.
        configs: each tenant with a config of its own -> the config (the others have the
            default: weight 1, no limits).
    """

    version: int
    keys: Mapping[str, KeyRecord]
    configs: Mapping[str, TenantConfig]

    def config(self, tenant: str) -> TenantConfig:
        """A tenant's config (the default where it has none)."""
        return self.configs.get(tenant) or TenantConfig()


def _version(raw: bytes | None) -> int:
    return int(raw) if raw else 0


async def read_version(client: RedisClient, keys: TenantKeys) -> int:
    """The store's version (one ``GET``)."""
    return _version(await client.get(keys.version))


def _decode(
    raw_keys: Mapping[bytes, bytes], raw_configs: Mapping[bytes, bytes]
) -> tuple[dict[str, KeyRecord], dict[str, TenantConfig]]:
    """The records and configs read; a malformed entry is left out, with a warning (the
    rest stays usable)."""
    records: dict[str, KeyRecord] = {}
    for digest, value in raw_keys.items():
        try:
            records[digest.decode()] = KeyRecord.from_json(value)
        except (ValueError, UnicodeDecodeError) as exc:
            logger.warning("tenant store: a key's record is malformed, ignored: %s", exc)
    return records, decode_configs(raw_configs)


def decode_configs(raw_configs: Mapping[bytes, bytes]) -> dict[str, TenantConfig]:
    """The store's ``config`` hash read: each tenant's config; an entry that is not a tenant's
    name or a valid config is left out, with a warning (the rest stays usable)."""
    configs: dict[str, TenantConfig] = {}
    for name, value in raw_configs.items():
        try:
            configs[check_tenant(name.decode())] = TenantConfig.from_json(value)
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            logger.warning("tenant store: a tenant's config is malformed, ignored: %s", exc)
    return configs


async def read_table(client: RedisClient, keys: TenantKeys) -> TenantTable:
    """The whole store: its version, then its keys and configs (one round trip)."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.get(keys.version)
        pipe.hgetall(keys.api_keys)
        pipe.hgetall(keys.config)
        version, raw_keys, raw_configs = await pipe.execute()
    records, configs = _decode(raw_keys or {}, raw_configs or {})
    return TenantTable(_version(version), records, configs)


@dataclass(frozen=True, slots=True)
class StoreChange:
    """One change of the store, from its log.

    Attributes:
        id: the log entry's id (read on from there).
        version: the store's version the change made.
        revoked: the sha256 (hex) of each key it revoked.
    """

    id: bytes
    version: int
    revoked: tuple[str, ...]


async def last_change_id(client: RedisClient, keys: TenantKeys) -> bytes:
    """The id of the store log's last entry (``0-0``: none), to wait for the next ones from."""
    last = await client.xrevrange(keys.changes, count=1)
    return bytes(last[0][0]) if last else b"0-0"


async def read_changes(
    client: RedisClient, keys: TenantKeys, after: bytes, *, block_ms: int
) -> list[StoreChange]:
    """The changes logged after the entry ``after``, waiting up to ``block_ms`` for one (an
    empty list: none came). An entry not of the store's form is skipped, with a warning."""
    answer = await client.xread({keys.changes: after}, count=100, block=bounded(client, block_ms))
    changes: list[StoreChange] = []
    for _stream, entries in answer or []:
        for entry_id, fields in entries:
            try:
                version = int(fields[b"version"])
                revoked = tuple(fields.get(b"revoked", b"").decode("ascii").split())
            except (KeyError, ValueError, UnicodeDecodeError) as exc:
                logger.warning("tenant store: a change %r is malformed, skipped: %r", entry_id, exc)
                revoked, version = (), 0
            changes.append(StoreChange(bytes(entry_id), version, revoked))
    return changes


class TenantStore:
    """Makes, lists, revokes and rotates API keys, and sets tenants' configs.

    Args:
        client: the Redis client (bytes replies).
        keys: the store's key names.
    """

    def __init__(self, client: RedisClient, keys: TenantKeys) -> None:
        self.client = client
        self.keys = keys

    async def table(self) -> TenantTable:
        """Every key's record and every tenant's config (never a key)."""
        return await read_table(self.client, self.keys)

    async def _change(
        self,
        change: Callable[[TenantTable], tuple[Callable[[RedisPipeline], None], _T]],
        *,
        revokes: Callable[[_T], list[str]] = lambda _: [],
    ) -> _T:
        """Apply ``change`` to the table as read, atomically: the writes it returns, the
        purge of keys whose grace period ended, ``INCR version`` and the change's entry in
        the log (the keys ``revokes`` names of its result, and those purged) in one
        ``MULTI``, watched on ``version`` (read again and retried if another writer moved
        it)."""
        while True:
            async with self.client.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(self.keys.version)
                    version = _version(await pipe.get(self.keys.version))
                    records, configs = _decode(
                        await pipe.hgetall(self.keys.api_keys) or {},
                        await pipe.hgetall(self.keys.config) or {},
                    )
                    write, result = change(TenantTable(version, records, configs))
                    now = time.time()
                    expired = [d for d, r in records.items() if not r.valid(now)]
                    pipe.multi()
                    write(pipe)
                    if expired:
                        pipe.hdel(self.keys.api_keys, *expired)
                    pipe.incr(self.keys.version)
                    revoked = " ".join([*revokes(result), *expired])
                    pipe.xadd(
                        self.keys.changes,
                        {"version": version + 1, "revoked": revoked},
                        maxlen=CHANGES_KEPT,
                        approximate=True,
                    )
                    await pipe.execute()
                    return result
                except WatchError:
                    continue

    async def create(
        self, tenant: str, *, admin: bool = False, config: Mapping[str, Any] | None = None
    ) -> tuple[str, KeyRecord, TenantConfig]:
        """A new key for ``tenant``; ``config`` changes the tenant's config (the fields given
        replace those it has; a new tenant starts from the default). Returns the key (shown
        once: only its hash is kept), its record and the tenant's config."""
        check_tenant(tenant)
        changes = dict(config or {})

        def change(table: TenantTable) -> tuple[Callable[[RedisPipeline], None], Any]:
            key, key_id = new_key()
            while any(r.id == key_id for r in table.keys.values()):
                key, key_id = new_key()
            record = KeyRecord(key_id, tenant, admin=admin, created=int(time.time()))
            merged = replace(table.config(tenant), **changes)

            def write(pipe: RedisPipeline) -> None:
                pipe.hset(self.keys.api_keys, key_hash(key), record.to_json())
                if changes or tenant not in table.configs:
                    pipe.hset(self.keys.config, tenant, merged.to_json())

            return write, (key, record, merged)

        result: tuple[str, KeyRecord, TenantConfig] = await self._change(change)
        return result

    async def configure(self, tenant: str, config: Mapping[str, Any]) -> TenantConfig:
        """Change ``tenant``'s config: the fields given replace those it has (a tenant
        without one starts from the default). Returns the new config."""
        check_tenant(tenant)
        changes = dict(config)

        def change(table: TenantTable) -> tuple[Callable[[RedisPipeline], None], TenantConfig]:
            merged = replace(table.config(tenant), **changes)

            def write(pipe: RedisPipeline) -> None:
                pipe.hset(self.keys.config, tenant, merged.to_json())

            return write, merged

        result: TenantConfig = await self._change(change)
        return result

    async def revoke(self, key_id: str) -> KeyRecord:
        """Revoke the key of this id at once (KeyError naming it if there is none)."""
        _check_id(key_id)

        def change(
            table: TenantTable,
        ) -> tuple[Callable[[RedisPipeline], None], tuple[str, KeyRecord]]:
            digest, record = _find(table, key_id)

            def write(pipe: RedisPipeline) -> None:
                pipe.hdel(self.keys.api_keys, digest)

            return write, (digest, record)

        _digest, record = await self._change(change, revokes=lambda found: [found[0]])
        return record

    async def rotate(self, key_id: str, *, grace_s: float = 0.0) -> tuple[str, KeyRecord]:
        """A new key for the tenant of key ``key_id`` (the same admin right); the old one is
        revoked, at once or after ``grace_s`` seconds. Returns the new key (shown once) and
        its record."""
        _check_id(key_id)
        if not grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s!r}")

        def change(table: TenantTable) -> tuple[Callable[[RedisPipeline], None], Any]:
            digest, old = _find(table, key_id)
            key, new_id = new_key()
            while any(r.id == new_id for r in table.keys.values()):
                key, new_id = new_key()
            now = time.time()
            record = KeyRecord(new_id, old.tenant, admin=old.admin, created=int(now))

            def write(pipe: RedisPipeline) -> None:
                pipe.hset(self.keys.api_keys, key_hash(key), record.to_json())
                if grace_s > 0:
                    ending = replace(old, expires=min(old.expires or now + grace_s, now + grace_s))
                    pipe.hset(self.keys.api_keys, digest, ending.to_json())
                else:
                    pipe.hdel(self.keys.api_keys, digest)

            return write, (key, record, "" if grace_s > 0 else digest)

        key, record, _revoked = await self._change(
            change, revokes=lambda made: [made[2]] if made[2] else []
        )
        return key, record


def _find(table: TenantTable, key_id: str) -> tuple[str, KeyRecord]:
    """The hash and record of the valid key of this id (KeyError naming it otherwise)."""
    now = time.time()
    for digest, record in table.keys.items():
        if record.id == key_id and record.valid(now):
            return digest, record
    raise KeyError(f"no key with the id {key_id!r} (batchline keys list shows them)")
