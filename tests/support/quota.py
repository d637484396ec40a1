"""What the quota tests share: tenants' configs written as ``batchline keys`` writes them,
Redis's minute, and a start with enough of it left."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import redis

from batchline.keys import QueueKeys, TenantKeys
from batchline.tenants import TenantConfig

from tests.support.service import wait_until

#: ``configure(tenant, config, wait=False)``.
Configure = Callable[..., None]


def redis_minute(client: redis.Redis) -> int:
    """The unix minute of Redis's clock (the one the quotas count in)."""
    s, us = client.time()
    return int((s * 1000 + us // 1000) // 60000)


def within_one_minute(client: redis.Redis, needed_s: float = 15) -> None:
    """Start where Redis's current minute has at least ``needed_s`` left, so that the counts
    of one minute are the test's: a wait to the next minute's start otherwise (not a race:
    the clock is read, not guessed)."""
    s, us = client.time()
    left = 60 - (s % 60 + us / 1e6)
    if left < needed_s:
        time.sleep(left + 0.05)


@pytest.fixture
def configure(rclient: redis.Redis, keys: QueueKeys) -> Iterator[Configure]:
    """``configure(tenant, config)``: a tenant's config in the tenant store (its version
    moved, as ``batchline keys`` does) and in the queue's ``tenants`` hash (as the workers
    mirror it; ``wait=True``: wait until a running worker has). The store is one for every
    queue of the prefix: the test's tenants leave it at the end."""
    store = TenantKeys(keys.prefix)
    written: list[str] = []

    def configure(tenant: str, config: TenantConfig, *, wait: bool = False) -> None:
        rclient.hset(store.config, tenant, config.to_json())
        rclient.incr(store.version)
        written.append(tenant)
        if wait:
            wait_until(
                lambda: rclient.hget(keys.tenants, tenant) == config.to_json().encode(),
                "the workers to mirror the tenant's config",
            )
        else:
            rclient.hset(keys.tenants, tenant, config.to_json())

    yield configure
    if written:  # the store as it was: none at all where it held only these
        rclient.hdel(store.config, *written)
        if rclient.hlen(store.config):
            rclient.incr(store.version)
        else:
            rclient.delete(store.version)
