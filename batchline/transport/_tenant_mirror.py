"""Tenants' configs, from the tenant store to each queue (docs/protocol.md, Tenants).

The tenant store (``<prefix>:{tenants}:config``, a hash: tenant -> JSON, and
``<prefix>:{tenants}:version``, a counter every change moves) is one slot for every queue;
the admission runs in a queue's slot, so the workers mirror the configs into the queue's
``tenants`` hash, where the admit function reads them (``HGET``). :class:`TenantMirror`
looks at the version at most once a second (one ``GET``) and copies the configs when it
moved.
"""

from __future__ import annotations

import logging
import time

from batchline.keys import QueueKeys, TenantKeys
from batchline.tenants import TenantConfig
from batchline.transport._client import RedisClient
from batchline.transport._tenants import decode_configs

__all__ = ["TenantMirror", "read_tenant_configs"]

logger = logging.getLogger(__name__)

#: How often a worker looks at the tenant store's version, at most (seconds).
MIRROR_EVERY_S = 1.0


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


async def read_tenant_configs(
    client: RedisClient, prefix: str
) -> tuple[int | None, dict[str, TenantConfig]]:
    """The tenant store's version (None: no store) and every valid tenant's config; an entry
    that is not a tenant's name or a valid config is left out (logged)."""
    keys = TenantKeys(prefix)
    raw_version = await client.get(keys.version)
    if raw_version is None:
        return None, {}
    try:
        version = int(raw_version)
    except ValueError:
        logger.warning("the tenant store's version %r is not an integer", raw_version)
        return None, {}
    return version, decode_configs(await client.hgetall(keys.config))


class TenantMirror:
    """Copies the tenant store's configs into one queue's ``tenants`` hash when the store's
    version moves (looking at most every ``every_s`` seconds)."""

    def __init__(self, keys: QueueKeys, *, every_s: float = MIRROR_EVERY_S) -> None:
        self.keys = keys
        self._every_s = every_s
        self._next = 0.0
        self.version: int | None = None

    async def step(self, client: RedisClient) -> bool:
        """Mirror if due and the version moved; returns whether it copied."""
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self._every_s
        raw = await client.get(TenantKeys(self.keys.prefix).version)
        seen = None if raw is None else _text(raw)
        if seen is None or seen == (None if self.version is None else str(self.version)):
            return False
        version, configs = await read_tenant_configs(client, self.keys.prefix)
        have = await client.hgetall(self.keys.tenants)
        gone = [name for name in have if _text(name) not in configs]
        async with client.pipeline(transaction=False) as pipe:
            if configs:
                pipe.hset(self.keys.tenants, mapping={t: c.to_json() for t, c in configs.items()})
            if gone:
                pipe.hdel(self.keys.tenants, *gone)
            await pipe.execute()
        self.version = version
        logger.info(
            "queue %r: tenants' configs mirrored (version %s, %d tenants)",
            self.keys.queue,
            version,
            len(configs),
        )
        return True
