"""The tenant store (batchline.transport.TenantStore) against a real redis-server: keys made,
shown once and stored hashed; listed without secrets; revoked and rotated; tenants' configs;
the version every change moves."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from types import SimpleNamespace

import pytest
import redis.exceptions
from redis.asyncio import Redis as AsyncRedis

from batchline.keys import TenantKeys
from batchline.tenants import TenantConfig
from batchline.transport import (
    KEY_PATTERN,
    TenantStore,
    _tenants,
    as_client,
    key_hash,
    key_id_of,
    last_change_id,
    read_changes,
    read_table,
    read_version,
)


@pytest.fixture
def tenant_keys() -> TenantKeys:
    """A store of its own (a prefix no other test uses) on the session's Redis."""
    return TenantKeys(prefix=f"ts{uuid.uuid4().hex[:10]}")


@pytest.fixture
def store(aclient: AsyncRedis, tenant_keys: TenantKeys) -> TenantStore:
    return TenantStore(as_client(aclient), tenant_keys)


async def test_a_key_is_random_shown_once_and_stored_as_its_hash(
    store: TenantStore, aclient: AsyncRedis, tenant_keys: TenantKeys
) -> None:
    key, record, config = await store.create("acme")
    other, _, _ = await store.create("acme")
    assert key != other
    match = KEY_PATTERN.fullmatch(key)
    assert match is not None
    assert match.group(1) == record.id == key_id_of(key)
    assert re.fullmatch(r"bl-[0-9a-f]{8}-[A-Za-z0-9_-]{43}", key)
    assert (record.tenant, record.admin, record.expires) == ("acme", False, None)
    assert config == TenantConfig()
    stored = await aclient.hgetall(tenant_keys.api_keys)
    assert set(stored) == {key_hash(key).encode(), key_hash(other).encode()}
    everything = b"".join(k + v for k, v in stored.items())
    configs = await aclient.hgetall(tenant_keys.config)
    everything += b"".join(k + v for k, v in configs.items())
    secret = key.split("-", 2)[2].encode()  # base64url: the secret may hold a "-" itself
    assert secret not in everything
    assert key.encode() not in everything
    assert json.loads(stored[key_hash(key).encode()])["tenant"] == "acme"


async def test_list_shows_ids_tenants_configs_and_never_a_secret(store: TenantStore) -> None:
    key, record, _ = await store.create("acme", config={"weight": 3.0, "requests_per_min": 60})
    admin_key, admin, _ = await store.create("ops", admin=True)
    table = await store.table()
    assert {r.id: (r.tenant, r.admin) for r in table.keys.values()} == {
        record.id: ("acme", False),
        admin.id: ("ops", True),
    }
    assert table.config("acme") == TenantConfig(weight=3.0, requests_per_min=60)
    assert table.config("ops") == TenantConfig()
    assert key not in repr(table)
    assert admin_key not in repr(table)


async def test_every_change_moves_the_version(store: TenantStore) -> None:
    versions = [await read_version(store.client, store.keys)]
    _, record, _ = await store.create("acme")
    versions.append(await read_version(store.client, store.keys))
    await store.configure("acme", {"tokens_per_min": 1000})
    versions.append(await read_version(store.client, store.keys))
    _, new, _ = await store.create("acme")
    versions.append(await read_version(store.client, store.keys))
    await store.rotate(new.id)
    versions.append(await read_version(store.client, store.keys))
    await store.revoke(record.id)
    versions.append(await read_version(store.client, store.keys))
    assert versions == sorted(set(versions)), versions
    assert versions[0] == 0
    assert (await store.table()).version == versions[-1]


async def test_create_merges_the_config_it_is_given_with_the_tenants(store: TenantStore) -> None:
    await store.create("acme", config={"weight": 2.0, "max_in_flight": 5})
    _, _, merged = await store.create("acme", config={"requests_per_min": 10})
    assert merged == TenantConfig(weight=2.0, max_in_flight=5, requests_per_min=10)
    _, _, kept = await store.create("acme")  # no config given: the tenant's stays
    assert kept == merged
    changed = await store.configure("acme", {"over_quota": "idle", "max_priority": 1})
    assert changed == replace_config(merged, over_quota="idle", max_priority=1)
    assert (await store.table()).config("acme") == changed
    with pytest.raises(ValueError, match="weight"):
        await store.configure("acme", {"weight": 0.0})
    with pytest.raises(ValueError, match="tenant"):
        await store.create("a.b")


def replace_config(config: TenantConfig, **changes: object) -> TenantConfig:
    data = json.loads(config.to_json())
    data.update(changes)
    return TenantConfig.from_json(json.dumps(data))


async def test_revoke_removes_the_key_and_names_an_unknown_id(store: TenantStore) -> None:
    key, record, _ = await store.create("acme")
    await store.revoke(record.id)
    table = await store.table()
    assert key_hash(key) not in table.keys
    with pytest.raises(KeyError, match=record.id):
        await store.revoke(record.id)
    with pytest.raises(ValueError, match="'nothex!'"):
        await store.revoke("nothex!")


async def test_rotate_makes_a_new_key_for_the_same_tenant(store: TenantStore) -> None:
    old_key, old, _ = await store.create("ops", admin=True, config={"weight": 4.0})
    new_key, new = await store.rotate(old.id)
    assert new.id != old.id
    assert (new.tenant, new.admin) == ("ops", True)
    table = await store.table()
    assert key_hash(old_key) not in table.keys
    assert table.keys[key_hash(new_key)] == new
    assert table.config("ops").weight == 4.0


async def test_rotate_with_a_grace_period_keeps_the_old_key_that_long(
    store: TenantStore,
) -> None:
    old_key, old, _ = await store.create("acme")
    new_key, _ = await store.rotate(old.id, grace_s=3600)
    table = await store.table()
    ending = table.keys[key_hash(old_key)]
    assert ending.expires is not None
    assert ending.valid(ending.expires - 1)
    assert not ending.valid(ending.expires)
    assert key_hash(new_key) in table.keys
    with pytest.raises(ValueError, match="grace_s"):
        await store.rotate(old.id, grace_s=-1)


async def test_a_key_past_its_grace_period_is_purged_by_the_next_change(
    store: TenantStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    old_key, old, _ = await store.create("acme")
    await store.rotate(old.id, grace_s=60)
    later = time.time() + 61  # the store's clock, a minute on
    monkeypatch.setattr(_tenants, "time", SimpleNamespace(time=lambda: later))
    with pytest.raises(KeyError):  # expired: no longer a key one can act on
        await store.rotate(old.id)
    await store.create("other")
    assert key_hash(old_key) not in (await store.table()).keys


async def test_concurrent_changes_all_land(store: TenantStore) -> None:
    """Every change is one MULTI watched on the version: none overwrites another's."""
    made = await asyncio.gather(*(store.create(f"t{i % 3}") for i in range(20)))
    table = await store.table()
    assert {key_hash(key) for key, _, _ in made} == set(table.keys)
    assert table.version == 20


async def test_each_change_is_logged_with_the_keys_it_revoked(
    store: TenantStore, tenant_keys: TenantKeys
) -> None:
    """The log the API replicas wait on: one entry a change, its version and the sha256 of
    each key it revoked (a rotation with a grace period revokes nothing yet)."""
    client = store.client
    start = await last_change_id(client, tenant_keys)
    assert start == b"0-0"
    key_a, a, _ = await store.create("acme")
    key_b, b, _ = await store.create("acme")
    await store.configure("acme", {"weight": 2.0})
    await store.revoke(a.id)
    new_b, _ = await store.rotate(b.id, grace_s=60)
    await store.rotate(b.id)  # the old one, before its grace period ends
    changes = await read_changes(client, tenant_keys, start, block_ms=1)
    assert [(c.version, c.revoked) for c in changes] == [
        (1, ()),
        (2, ()),
        (3, ()),
        (4, (key_hash(key_a),)),
        (5, ()),
        (6, (key_hash(key_b),)),
    ]
    assert await last_change_id(client, tenant_keys) == changes[-1].id
    assert await read_changes(client, tenant_keys, changes[-1].id, block_ms=1) == []
    assert key_hash(new_b) in (await store.table()).keys


async def test_a_malformed_entry_is_left_out_and_the_rest_read(
    store: TenantStore, aclient: AsyncRedis, tenant_keys: TenantKeys
) -> None:
    key, _, _ = await store.create("acme")
    await aclient.hset(tenant_keys.api_keys, "f" * 64, "not json")
    await aclient.hset(tenant_keys.config, "bad", '{"weight": -1}')
    table = await read_table(store.client, tenant_keys)
    assert set(table.keys) == {key_hash(key)}
    assert "bad" not in table.configs


async def test_the_web_backends_producer_user_reads_the_store_only_with_api_keys(
    store: TenantStore, aclient: AsyncRedis, tenant_keys: TenantKeys, redis_url: str
) -> None:
    """`batchline acl --api-keys`: the producer user of a web backend checking API keys may
    read the tenant store, and not write it; without the flag it may not read it."""
    from batchline.acl import acl_rules
    from batchline.keys import QueueKeys

    await store.create("acme")
    queue = QueueKeys("q", tenant_keys.prefix)
    password = uuid.uuid4().hex
    names = []
    try:
        for api_keys in (True, False):
            name = f"web-{uuid.uuid4().hex[:8]}"
            names.append(name)
            rules = acl_rules(queue, "producer", api_keys=api_keys)
            await aclient.execute_command("ACL", "SETUSER", name, "on", f">{password}", *rules)
            user = AsyncRedis.from_url(
                redis_url, username=name, password=password, lib_name=None, lib_version=None
            )
            try:
                if api_keys:
                    table = await read_table(as_client(user), tenant_keys)
                    assert [r.tenant for r in table.keys.values()] == ["acme"]
                    assert await last_change_id(as_client(user), tenant_keys) != b"0-0"
                    changes = await read_changes(as_client(user), tenant_keys, b"0", block_ms=1)
                    assert [c.version for c in changes] == [1]
                    with pytest.raises(redis.exceptions.NoPermissionError):
                        await user.hset(tenant_keys.api_keys, "x", "y")
                    with pytest.raises(redis.exceptions.NoPermissionError):
                        await user.xadd(tenant_keys.changes, {"version": 9, "revoked": ""})
                else:
                    with pytest.raises(redis.exceptions.NoPermissionError):
                        await user.hgetall(tenant_keys.api_keys)
            finally:
                await user.aclose()
    finally:
        for name in names:
            await aclient.execute_command("ACL", "DELUSER", name)
