"""Tenants on a 3-node Redis Cluster: the tenant store through ``batchline keys``, the workers'
mirror of the configs into each queue's slot, tenants' producers through a worker with the
fair share on, a quota's refusal, ``batchline usage``, ``batchline status --by-tenant``, and
the HTTP API checking two tenants' keys (uvicorn, the official client), each a stranger to
the other's jobs and files.

The cluster is started for this module (tests/e2e/test_cluster.py's), and stopped at its end.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from redis.cluster import RedisCluster

from batchline.acl import tenant_rules
from batchline.config import ServiceSettings, WebSettings
from batchline.contrib._plumbing import KeyTable
from batchline.contrib.fastapi import create_app
from batchline.errors import QuotaExceeded, TenantNotAllowed
from batchline.keys import QueueKeys, TenantKeys
from batchline.producer import AsyncProducer
from batchline.tenants import TenantConfig
from batchline.transport import KEY_PATTERN, TenantStore, connect, read_table

from tests.contrib.openai.test_openai import client_for
from tests.contrib.test_fastapi import MODEL, Serve, serve
from tests.e2e.test_cluster import _queues_on_different_nodes, cluster_url
from tests.support import models_for_tests
from tests.support.quota import redis_minute, within_one_minute
from tests.support.replies_by_hand import eventually
from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerThread,
    run_cli,
    spec,
    wait_until,
)

__all__ = ["cluster_url", "serve"]  # fixtures, used here

pytestmark = pytest.mark.slow  # a 3-node Redis Cluster, started for this module

openai = pytest.importorskip("openai")

TENANTS = ("acme", "globex")


@pytest.fixture
def prefix() -> str:
    """A namespace of its own: this test's tenant store and queues."""
    return f"ct{uuid.uuid4().hex[:8]}"


@pytest.fixture
def admin(cluster_url: str) -> Iterator[RedisCluster]:
    """A blocking cluster client that looks at the keys."""
    client = RedisCluster.from_url(cluster_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def env(cluster_url: str, prefix: str) -> dict[str, str]:
    """The ``batchline`` command's settings for the cluster and this test's prefix."""
    return {
        "BATCHLINE_REDIS_URL": cluster_url,
        "BATCHLINE_REDIS_CLUSTER": "true",
        "BATCHLINE_PREFIX": prefix,
    }


def cli(env: dict[str, str], *args: str) -> Any:
    """``batchline ARGS``'s JSON answer (it must succeed)."""
    done = run_cli(*args, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def queue_away_from_the_store(admin: RedisCluster, prefix: str) -> str:
    """A queue whose slot is on another node than the tenant store's: the mirror crosses
    nodes."""
    store_node = admin.get_node_from_key(TenantKeys(prefix).version).name
    for name in _queues_on_different_nodes(admin):
        if admin.get_node_from_key(QueueKeys(name, prefix).inbox).name != store_node:
            return name
    raise AssertionError("no queue away from the tenant store's node")


def settings_for(cluster_url: str, queue: str, prefix: str) -> dict[str, Any]:
    """A worker's or producer's settings for ``queue`` on the cluster."""
    return {"redis_url": cluster_url, "redis_cluster": True, "queue": queue, "prefix": prefix}


def mirrored(admin: RedisCluster, keys: QueueKeys) -> dict[str, TenantConfig]:
    """The configs in the queue's ``tenants`` hash (the workers' mirror)."""
    return {
        name.decode(): TenantConfig.from_json(value)
        for name, value in admin.hgetall(keys.tenants).items()
    }


def test_keys_on_a_cluster(env: dict[str, str], admin: RedisCluster, prefix: str) -> None:
    made = cli(env, "keys", "create", "--tenant", "acme", "--weight", "3", "--json")
    assert KEY_PATTERN.fullmatch(made["key"])
    admin_key = cli(env, "keys", "create", "--tenant", "ops", "--admin", "--json")
    cli(env, "keys", "set", "--tenant", "acme", "--requests-per-min", "60")
    rotated = cli(env, "keys", "rotate", made["id"], "--grace-s", "600", "--json")
    listing = cli(env, "keys", "list", "--json")
    assert {(k["id"], k["tenant"]) for k in listing["keys"]} == {
        (made["id"], "acme"),
        (rotated["id"], "acme"),
        (admin_key["id"], "ops"),
    }
    assert listing["tenants"]["acme"]["weight"] == 3.0
    assert listing["tenants"]["acme"]["requests_per_min"] == 60
    done = run_cli("keys", "revoke", made["id"], env=env)
    assert done.returncode == 0, done.stderr
    assert {k["id"] for k in cli(env, "keys", "list", "--json")["keys"]} == {
        rotated["id"],
        admin_key["id"],
    }
    store = TenantKeys(prefix)
    slots = {admin.keyslot(k) for k in (store.api_keys, store.config, store.version)}
    assert len(slots) == 1
    assert int(admin.get(store.version) or 0) == 5  # one move a change


async def test_concurrent_changes_from_many_clients_lose_none(
    cluster_url: str, prefix: str
) -> None:
    """Each change is a transaction watched on the version: on a cluster as on one server,
    writers racing from clients of their own each land once."""
    settings = ServiceSettings(redis_url=SecretStr(cluster_url), redis_cluster=True, prefix=prefix)

    async def create(i: int) -> None:
        client = connect(settings)
        try:
            await TenantStore(client, TenantKeys(prefix)).create(f"t{i}", config={"weight": i + 1})
        finally:
            await client.aclose()

    await asyncio.gather(*(create(i) for i in range(12)))
    client = connect(settings)
    try:
        table = await read_table(client, TenantKeys(prefix))
    finally:
        await client.aclose()
    assert table.version == 12
    assert sorted(r.tenant for r in table.keys.values()) == sorted(f"t{i}" for i in range(12))
    assert {t: c.weight for t, c in table.configs.items()} == {f"t{i}": i + 1.0 for i in range(12)}


async def test_the_api_key_table_follows_the_stores_log_on_a_cluster(
    cluster_url: str, prefix: str
) -> None:
    """The API replicas' wait on the store's log (XREAD BLOCK) routed to the store's node:
    with the version check as good as off, a revoke still reaches the table."""
    settings = ServiceSettings(redis_url=SecretStr(cluster_url), redis_cluster=True, prefix=prefix)
    client = connect(settings)
    store = TenantStore(client, TenantKeys(prefix))
    try:
        kept, _, _ = await store.create("acme")
        revoked, record, _ = await store.create("acme")
        table = KeyTable(store=lambda: connect(settings), keys=TenantKeys(prefix), refresh_s=3600)
        async with table.running():
            assert table.lookup(revoked) is not None
            await store.revoke(record.id)
            await eventually(lambda: table.lookup(revoked) is None, "the revoke from the log")
            assert table.lookup(kept) is not None
    finally:
        await client.aclose()


async def test_tenants_producers_quota_usage_and_status_on_a_cluster(
    cluster_url: str,
    env: dict[str, str],
    admin: RedisCluster,
    prefix: str,
    start_worker: Callable[..., WorkerThread],
) -> None:
    queue = queue_away_from_the_store(admin, prefix)
    keys = QueueKeys(queue, prefix)
    cli(env, "keys", "create", "--tenant", "acme", "--weight", "3", "--json")
    cli(env, "keys", "create", "--tenant", "globex", "--requests-per-min", "2", "--json")
    common = settings_for(cluster_url, queue, prefix)
    start_worker(fair_share=True, **common)
    expected = {"acme": TenantConfig(weight=3.0), "globex": TenantConfig(requests_per_min=2)}
    wait_until(lambda: mirrored(admin, keys) == expected, "the configs mirrored")

    sent = {"acme": 4, "globex": 2}

    async def serve_tenant(tenant: str) -> list[str]:
        async with AsyncProducer(**common, tenant=tenant) as producer:
            return await producer.map([f"{tenant} {i}" for i in range(sent[tenant])])

    node = admin.get_redis_connection(admin.get_node_from_key(keys.inbox))
    within_one_minute(node, 30)  # globex's 2 requests and its third in one minute
    minute = redis_minute(node)
    answers = await asyncio.gather(*(serve_tenant(t) for t in sent))
    assert answers == [[f"{t} {i}" for i in range(n)] for t, n in sent.items()]
    async with AsyncProducer(**common, tenant="globex") as producer:
        with pytest.raises(QuotaExceeded) as refused:
            await producer.infer("a third in one minute", timeout_s=RESULT_TIMEOUT_S)
    assert redis_minute(node) == minute
    assert refused.value.tenant == "globex"
    assert "requests_per_min" in str(refused.value)
    assert 0 < refused.value.retry_after_s <= 60
    async with AsyncProducer(**common) as producer:
        assert await producer.infer("untenanted", timeout_s=RESULT_TIMEOUT_S) == "untenanted"
    assert admin.xlen(keys.dead) == 0

    queue_env = {**env, "BATCHLINE_QUEUE": queue}
    usage = cli(queue_env, "usage", "--json")
    rows = {r["tenant"]: (r["requests"], r["items"]) for r in usage["days"]}
    assert rows == {"-": (1, 1), "acme": (4, 4), "globex": (2, 2)}
    # Summed over two queues on two nodes.
    other = next(q for q in _queues_on_different_nodes(admin) if q != queue)
    start_worker(**settings_for(cluster_url, other, prefix))
    async with AsyncProducer(**settings_for(cluster_url, other, prefix), tenant="acme") as producer:
        assert await producer.infer("elsewhere", timeout_s=RESULT_TIMEOUT_S) == "elsewhere"
    usage = cli(env, "usage", "--queue", queue, "--queue", other, "--json")
    rows = {r["tenant"]: (r["requests"], r["items"]) for r in usage["days"]}
    assert rows == {"-": (1, 1), "acme": (5, 5), "globex": (2, 2)}
    tenants = {t["tenant"]: t for t in cli(queue_env, "status", "--by-tenant", "--json")["tenants"]}
    assert {t: f["requests_today"] for t, f in tenants.items()} == {"-": 1, **sent}
    assert all(f["in_flight"] == 0 and f["queued"] == 0 for f in tenants.values())

    # A change of the store is mirrored again: globex without a limit.
    cli(env, "keys", "set", "--tenant", "globex", "--requests-per-min", "0")
    expected["globex"] = TenantConfig()
    wait_until(lambda: mirrored(admin, keys) == expected, "the new config mirrored")
    async with AsyncProducer(**common, tenant="globex") as producer:
        assert await producer.infer("unlimited", timeout_s=RESULT_TIMEOUT_S) == "unlimited"


async def test_the_fair_share_on_a_cluster(
    cluster_url: str,
    admin: RedisCluster,
    prefix: str,
    start_worker: Callable[..., WorkerThread],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tenants' producers queue 40 requests of A's, then 4 of B's, while no worker runs; then
    one worker, a request a batch: B's are served among A's first ones (first come,
    first served would serve them after all of A's)."""
    record = tmp_path / "batches.jsonl"
    monkeypatch.setenv("BLTEST_RECORD_FILE", str(record))
    queue = queue_away_from_the_store(admin, prefix)
    common = settings_for(cluster_url, queue, prefix)
    start_worker(**common).stop()  # (it loads the queue's functions on the queue's node)
    async with (
        AsyncProducer(**common, tenant="A") as a,
        AsyncProducer(**common, tenant="B") as b,
    ):
        handles = [(a, await a.submit(f"A{i}")) for i in range(40)]
        handles += [(b, await b.submit(f"B{i}")) for i in range(4)]
        start_worker(spec("record_batches"), batch_size=1, timeout_ms=0, **common)
        for producer, handle in handles:
            await producer.result(handle, timeout_s=RESULT_TIMEOUT_S)
    order = [item for batch in models_for_tests.read_batches(record) for item in batch]
    assert sorted(order) == sorted([f"A{i}" for i in range(40)] + [f"B{i}" for i in range(4)])
    assert max(order.index(f"B{i}") for i in range(4)) < 12, order
    assert admin.xlen(QueueKeys(queue, prefix).dead) == 0


async def test_a_tenants_redis_user_on_a_cluster(
    cluster_url: str,
    admin: RedisCluster,
    prefix: str,
    start_worker: Callable[..., WorkerThread],
) -> None:
    """``batchline acl --tenant``'s user, made on every node: it enqueues and waits as its
    tenant through the cluster client (slot map, functions), and never as another."""
    queue = queue_away_from_the_store(admin, prefix)
    keys = QueueKeys(queue, prefix)
    common = settings_for(cluster_url, queue, prefix)
    start_worker(**common)
    user, password = f"{prefix}-tenant-acme", uuid.uuid4().hex
    nodes = [admin.get_redis_connection(node) for node in admin.get_nodes()]
    for node in nodes:
        node.execute_command(
            "ACL", "SETUSER", user, "reset", "on", f">{password}", *tenant_rules(keys, "acme")
        )
    as_acme = {**common, "redis_url": cluster_url.replace("//", f"//{user}:{password}@", 1)}
    try:
        async with AsyncProducer(**as_acme, tenant="acme") as producer:
            assert await producer.infer("acme's", timeout_s=RESULT_TIMEOUT_S) == "acme's"
            with pytest.raises(TenantNotAllowed, match="'globex'"):
                await producer.submit("as another", tenant="globex")
    finally:
        for node in nodes:
            node.execute_command("ACL", "DELUSER", user)


def test_two_tenants_keys_over_http_on_a_cluster(
    cluster_url: str,
    env: dict[str, str],
    admin: RedisCluster,
    prefix: str,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
) -> None:
    queue = queue_away_from_the_store(admin, prefix)
    start_worker(MODEL, **settings_for(cluster_url, queue, prefix))
    keys = {t: cli(env, "keys", "create", "--tenant", t, "--json")["key"] for t in TENANTS}
    keys["ops"] = cli(env, "keys", "create", "--tenant", "ops", "--admin", "--json")["key"]
    settings = WebSettings(
        redis_url=SecretStr(cluster_url),
        redis_cluster=True,
        prefix=prefix,
        queue=queue,
        embedding_queue=queue,
        api_keys=True,
    )
    http = serve(create_app(settings, timeout_s=RESULT_TIMEOUT_S))
    for key in keys.values():
        answer = (
            client_for(http)
            .with_options(api_key=key)
            .embeddings.create(model=queue, input=["one", "two"])
        )
        assert len(answer.data) == 2
    with pytest.raises(openai.AuthenticationError):
        client_for(http).with_options(api_key=keys["acme"][:-1] + "x").models.list()

    def auth(tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {keys[tenant]}"}

    job = http.post("/jobs", json={"text": "acme's"}, headers=auth("acme"))
    assert job.status_code in (200, 202), job.text
    job_id = job.json()["id"]
    assert job_id.startswith("acme.")
    wait_until(
        lambda: http.get(f"/jobs/{job_id}", headers=auth("acme")).json().get("status") == "ok",
        "acme's job done",
    )
    assert http.get(f"/jobs/{job_id}", headers=auth("globex")).status_code == 404
    assert http.get(f"/jobs/{job_id}", headers=auth("ops")).status_code == 200

    acme = client_for(http).with_options(api_key=keys["acme"])
    globex = client_for(http).with_options(api_key=keys["globex"])
    line = {"custom_id": "1", "method": "POST", "url": "/v1/embeddings"}
    line["body"] = {"model": queue, "input": "x"}  # type: ignore[assignment]
    uploaded = acme.files.create(
        file=("in.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch"
    )
    assert acme.files.retrieve(uploaded.id).id == uploaded.id
    with pytest.raises(openai.NotFoundError):
        globex.files.retrieve(uploaded.id)
    assert [f.id for f in globex.files.list()] == []
    assert [f.id for f in acme.files.list()] == [uploaded.id]
    ops = client_for(http).with_options(api_key=keys["ops"])
    assert ops.files.retrieve(uploaded.id).id == uploaded.id
    batch = acme.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    with pytest.raises(openai.NotFoundError):
        globex.batches.retrieve(batch.id)
    assert [b.id for b in globex.batches.list()] == []
    assert ops.batches.retrieve(batch.id).id == batch.id
    wait_until(  # its line enqueued in acme's name, through the queue's slot
        lambda: acme.batches.retrieve(batch.id).status in ("completed", "failed"),
        "acme's batch done",
    )
    done = acme.batches.retrieve(batch.id)
    assert (done.status, done.request_counts.completed) == ("completed", 1), done

    # A revoke reaches the API through the store's log, on the store's node.
    acme_id = next(
        k["id"] for k in cli(env, "keys", "list", "--json")["keys"] if k["tenant"] == "acme"
    )
    assert run_cli("keys", "revoke", acme_id, env=env).returncode == 0
    wait_until(lambda: http.get("/v1/models", headers=auth("acme")).status_code == 401, "401")
    assert http.get("/v1/models", headers=auth("globex")).status_code == 200
