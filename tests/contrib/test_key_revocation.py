"""A revoked key on the API's replicas (batchline.contrib._plumbing._auth): refused on two
uvicorn processes within a second of ``batchline keys revoke`` returning; told by the tenant
store's log, not by the version check (the first request after it arrives is refused); a
revoke made while a replica is cut off from Redis, applied once it reads Redis again; and a
replica cut off for longer than ``max_stale_s``, refusing the store's keys (503)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest
import redis
from pydantic import SecretStr

from batchline.acl import acl_rules
from batchline.config import WebSettings
from batchline.contrib._plumbing import KeyTable
from batchline.contrib.fastapi import create_app
from batchline.keys import QueueKeys, TenantKeys
from batchline.transport import (
    KeyRecord,
    StoreChange,
    TenantTable,
    connect,
    key_hash,
)

from .test_fastapi import Serve, serve
from .test_keys import STATIC, Keys
from tests.support.app_process import app_in_process
from tests.support.replies_by_hand import eventually
from tests.support.service import run_cli, subprocess_env, wait_until

__all__ = ["serve"]  # a fixture, used here

#: The promise: a revoke holds on every replica within a second of ``keys revoke`` returning.
WITHIN_S = 1.0


@pytest.fixture
def prefix() -> str:
    return f"r{uuid.uuid4().hex[:10]}"


@pytest.fixture
def store(redis_url: str, prefix: str) -> Keys:
    return Keys(redis_url, prefix)


@contextlib.contextmanager
def replica(redis_url: str, prefix: str, queue: str) -> Iterator[httpx.Client]:
    """The API, checking the store's keys, in a uvicorn process of its own."""
    env = {
        "BATCHLINE_REDIS_URL": redis_url,
        "BATCHLINE_PREFIX": prefix,
        "BATCHLINE_QUEUE": queue,
        "BATCHLINE_API_KEYS": "true",
    }
    with (
        app_in_process(subprocess_env(env)) as (_proc, url),
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        yield http


@pytest.mark.slow
def test_a_revoked_key_is_refused_on_two_replica_processes_within_a_second(
    redis_url: str, prefix: str, queue: str, store: Keys
) -> None:
    kept, _ = store.create("acme")
    revoked, record = store.create("acme")
    with replica(redis_url, prefix, queue) as one, replica(redis_url, prefix, queue) as two:
        https = [one, two]
        for http in https:
            for key in (kept, revoked):
                assert http.get("/v1/models", headers={"x-api-key": key}).status_code == 200
        go = threading.Event()
        started: list[float] = []
        refused_after: dict[int, float] = {}

        def first_401(i: int, http: httpx.Client) -> None:
            go.wait()
            while time.monotonic() - started[0] < 30:  # (the test's own bound, not the promise)
                if http.get("/v1/models", headers={"x-api-key": revoked}).status_code == 401:
                    refused_after[i] = time.monotonic() - started[0]
                    return

        threads = [threading.Thread(target=first_401, args=(i, h)) for i, h in enumerate(https)]
        for thread in threads:
            thread.start()
        env = {"BATCHLINE_REDIS_URL": redis_url, "BATCHLINE_PREFIX": prefix}
        done = run_cli("keys", "revoke", record.id, env=env)
        started.append(time.monotonic())
        go.set()
        assert done.returncode == 0, done.stderr
        for thread in threads:
            thread.join()
        assert sorted(refused_after) == [0, 1], refused_after
        assert max(refused_after.values()) <= WITHIN_S, refused_after
        for http in https:
            assert http.get("/v1/models", headers={"x-api-key": kept}).status_code == 200


# -- in one process: the table told by the log ------------------------------------------------


def table_for(url: str, prefix: str, **options: float) -> KeyTable:
    settings = WebSettings(redis_url=SecretStr(url), prefix=prefix)
    return KeyTable(store=lambda: connect(settings), keys=TenantKeys(prefix), **options)


async def test_a_revoke_reaches_the_table_by_the_stores_log_alone(
    redis_url: str, prefix: str, store: Keys
) -> None:
    """With the version check as good as off (once an hour), the log alone tells the table
    of a revoke, and of a new key."""
    kept, _ = await asyncio.to_thread(store.create, "acme")
    revoked, record = await asyncio.to_thread(store.create, "acme")
    table = table_for(redis_url, prefix, refresh_s=3600)
    async with table.running():
        assert table.lookup(revoked) is not None
        version = await asyncio.to_thread(store.revoke, record.id)
        await eventually(lambda: table.version >= version, "the revoke read from the log")
        assert table.lookup(revoked) is None
        assert table.lookup(kept) is not None
        new, _ = await asyncio.to_thread(store.create, "globex")
        await eventually(lambda: table.lookup(new), "the new key read from the log")


def test_a_change_from_the_log_drops_its_keys_before_any_read() -> None:
    """The first request after a revoke reaches a replica is refused: the change drops the
    key at once (no Redis call), and a read of the store begun before the revoke, installed
    after it, does not bring the key back."""
    key, other = "bl-0123abcd-" + "E" * 43, "bl-0123abce-" + "F" * 43
    records = {
        key_hash(key): KeyRecord("0123abcd", "acme"),
        key_hash(other): KeyRecord("0123abce", "acme"),
    }
    table = KeyTable(store=lambda: connect(WebSettings()))
    table.install(TenantTable(4, records, {}))
    assert table.apply(StoreChange(b"1-0", 5, (key_hash(key),))) is True  # (read it again)
    assert table.lookup(key) is None
    table.install(TenantTable(4, records, {}))  # a read from before the revoke
    assert table.lookup(key) is None
    assert table.lookup(other) is not None
    table.install(TenantTable(5, {key_hash(other): records[key_hash(other)]}, {}))
    assert table.lookup(key) is None
    assert table.apply(StoreChange(b"2-0", 5, ())) is False  # (nothing to read)


def test_a_replica_cut_off_longer_than_max_stale_s_refuses_the_stores_keys() -> None:
    key, static = "bl-0123abcd-" + "G" * 43, "static-" + uuid.uuid4().hex
    now = [100.0]
    table = KeyTable(
        static_key=static,
        store=lambda: connect(WebSettings()),
        max_stale_s=30,
        clock=lambda: now[0],
    )
    table.install(TenantTable(3, {key_hash(key): KeyRecord("0123abcd", "acme")}, {}))
    now[0] += 30
    assert table.usable
    assert table.lookup(key) is not None  # the table it has, for max_stale_s
    now[0] += 0.5
    assert not table.usable  # (the API answers 503, not 401)
    assert table.lookup(key) is None
    assert table.lookup(static) is not None  # needs no Redis
    table.install(TenantTable(3, {key_hash(key): KeyRecord("0123abcd", "acme")}, {}))
    assert table.usable
    assert table.lookup(key) is not None
    with pytest.raises(ValueError, match="max_stale_s"):
        KeyTable(store=lambda: connect(WebSettings()), max_stale_s=0)


async def test_a_revoke_made_while_a_replica_is_cut_off_holds_once_it_reads_redis_again(
    redis_url: str,
    prefix: str,
    store: Keys,
    acl_user: Callable[[list[str]], str],
    rclient: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The replica's Redis user turned off (its connections cut, new ones refused): it goes
    on with the table it has; a revoke made then holds once it reads Redis again."""
    caplog.set_level(logging.INFO, logger="batchline.contrib._plumbing._auth")
    rules = acl_rules(QueueKeys("q", prefix), "producer", api_keys=True)
    url = acl_user(["on", ">PASSWORD", *rules])
    user = url.split("//", 1)[1].split(":", 1)[0]
    kept, _ = await asyncio.to_thread(store.create, "acme")
    revoked, record = await asyncio.to_thread(store.create, "acme")
    table = table_for(url, prefix)
    async with table.running():
        assert table.lookup(revoked) is not None
        rclient.execute_command("ACL", "SETUSER", user, "off")
        rclient.execute_command("CLIENT", "KILL", "USER", user)
        await eventually(lambda: "cannot be read" in caplog.text, "the replica cut off")
        version = await asyncio.to_thread(store.revoke, record.id)
        assert table.usable  # cut off, it cannot know of the revoke: the table it has
        assert table.lookup(revoked) is not None
        assert table.lookup(kept) is not None

        rclient.execute_command("ACL", "SETUSER", user, "on")
        await eventually(lambda: table.version >= version, "the store read again")
        assert table.lookup(revoked) is None
        assert table.lookup(kept) is not None
        assert "is read again" in caplog.text


@pytest.mark.slow
def test_an_api_cut_off_from_redis_answers_503_past_max_stale_s_and_serves_once_back(
    redis_url: str,
    prefix: str,
    queue: str,
    store: Keys,
    acl_user: Callable[[list[str]], str],
    rclient: redis.Redis,
    serve: Serve,
) -> None:
    rules = acl_rules(QueueKeys(queue, prefix), "producer", api_keys=True)
    url = acl_user(["on", ">PASSWORD", *rules])
    user = url.split("//", 1)[1].split(":", 1)[0]
    key, _ = store.create("acme")
    settings = WebSettings(
        redis_url=SecretStr(url),
        prefix=prefix,
        queue=queue,
        api_keys=True,
        api_keys_max_stale_s=1,
        api_key=SecretStr(STATIC),
    )
    http = serve(create_app(settings))
    auth = {"x-api-key": key}
    assert http.get("/v1/models", headers=auth).status_code == 200
    rclient.execute_command("ACL", "SETUSER", user, "off")
    rclient.execute_command("CLIENT", "KILL", "USER", user)
    refused = wait_until(
        lambda: (r := http.get("/v1/models", headers=auth)).status_code == 503 and r,
        "the store's keys refused past max_stale_s",
    )
    assert refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "service_unavailable"
    assert http.get("/v1/models", headers={"x-api-key": STATIC}).status_code == 200
    rclient.execute_command("ACL", "SETUSER", user, "on")
    wait_until(lambda: http.get("/v1/models", headers=auth).status_code == 200, "served again")


async def test_a_redis_user_that_may_not_read_the_log_still_sees_a_revoke_by_the_version(
    redis_url: str,
    prefix: str,
    store: Keys,
    acl_user: Callable[[list[str]], str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An API user made by an earlier ``batchline acl --api-keys`` (GET and HGETALL on the
    store, no XREAD): one warning saying so, and revokes hold by the version check."""
    caplog.set_level(logging.INFO, logger="batchline.contrib._plumbing._auth")
    older = [f"(%R~{TenantKeys(prefix).base}:* +get +hgetall)"]
    url = acl_user(["on", ">PASSWORD", *acl_rules(QueueKeys("q", prefix), "producer"), *older])
    revoked, record = await asyncio.to_thread(store.create, "acme")
    table = table_for(url, prefix)
    async with table.running():
        await eventually(lambda: "may not read" in caplog.text, "the warning")
        assert table.lookup(revoked) is not None
        version = await asyncio.to_thread(store.revoke, record.id)
        await eventually(lambda: table.version >= version, "the version check")
        assert table.lookup(revoked) is None
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned
    assert "batchline acl --api-keys" in warned[0]
