"""Redis behind Sentinel, failed over under load: a primary, two replicas and three
sentinels as local processes (tests/support/replicated.py), producers and a worker that
know only the ``redis+sentinel://`` URL. With ``durability="replicated"`` every request a
producer accepted is answered, exactly once, through a primary killed mid-load and through a
primary frozen long enough to be failed over and then resumed. Bad days: a service the
sentinels do not know, no sentinel up, a replica count that can never be met: each a clear,
typed error, nothing accepted that is not held as promised.

The long variant, with figures for ``async`` too: ``python -m checks.failover``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from batchline.config import ProducerSettings
from batchline.errors import NotReplicated
from batchline.producer import AsyncProducer
from batchline.transport import RedisUnreachable, connect, wait_for_redis

from tests.support.replicated import ReplicatedRedis, available
from tests.support.service import WorkerThread

pytestmark = [
    pytest.mark.slow,  # several redis-server processes, failed over
    pytest.mark.skipif(not available(), reason="needs Debian's redis-server (Sentinel)"),
]

T = 60.0


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[ReplicatedRedis]:
    servers = ReplicatedRedis(tmp_path)
    try:
        yield servers
    finally:
        servers.stop()


async def load(
    producer: AsyncProducer, n: int, rate_per_s: float, during: Callable[[], Any] | None
) -> dict[str, Any]:
    """Submit ``n`` requests at about ``rate_per_s``, each resubmitted with its own id until
    accepted (as a client does after a refusal); ``during`` runs at the half. Returns the
    handles of the accepted, by value, and the refusals seen."""
    accepted: dict[int, Any] = {}
    refused: list[str] = []

    async def one(i: int) -> None:
        rid = f"req-{i}"
        for _ in range(200):
            try:
                accepted[i] = await producer.submit(i, request_id=rid)
                return
            except NotReplicated:
                refused.append("NotReplicated")
            except Exception as exc:  # a refusal while no primary is named, say
                refused.append(type(exc).__name__)
            await asyncio.sleep(0.1)
        raise AssertionError(f"request {rid} was never accepted")

    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one(i)))
        if during is not None and i == n // 2:
            await asyncio.to_thread(during)
        await asyncio.sleep(1 / rate_per_s)
    await asyncio.gather(*tasks)
    return {"accepted": accepted, "refused": refused}


async def answered_once(producer: AsyncProducer, accepted: dict[int, Any]) -> None:
    for value, handle in accepted.items():
        result = await producer.wait(handle, timeout_s=T)
        assert (result.status, result.output) == ("ok", value), result


@pytest.mark.timeout(240)
async def test_a_primary_killed_under_load_loses_no_accepted_request(
    replicated: ReplicatedRedis, start_worker: Callable[..., WorkerThread], queue: str
) -> None:
    common: dict[str, Any] = {
        "redis_url": replicated.url,
        "queue": queue,
        "durability": "replicated",
        "min_replicas": 1,
    }
    start_worker(batch_size=8, **common)
    async with AsyncProducer(**common) as producer:
        old: list[int] = []

        def kill() -> None:
            old.append(replicated.kill_primary())

        outcome = await load(producer, 300, 100.0, kill)
        new = replicated.wait_failover(old[0])
        assert new != old[0]
        await answered_once(producer, outcome["accepted"])
    assert len(outcome["accepted"]) == 300


@pytest.mark.timeout(240)
async def test_a_primary_frozen_past_a_failover_then_resumed_loses_nothing(
    replicated: ReplicatedRedis, start_worker: Callable[..., WorkerThread], queue: str
) -> None:
    common: dict[str, Any] = {
        "redis_url": replicated.url,
        "queue": queue,
        "durability": "replicated",
        "min_replicas": 1,
        "replication_timeout_ms": 500,
    }
    start_worker(batch_size=8, **common)
    async with AsyncProducer(**common) as producer:

        def freeze() -> None:
            frozen = replicated.freeze_primary()
            replicated.wait_failover(frozen)
            replicated.resume(frozen)  # it believes it is primary until Sentinel says not

        outcome = await load(producer, 200, 100.0, freeze)
        await answered_once(producer, outcome["accepted"])
    assert len(outcome["accepted"]) == 200


async def test_an_unknown_service_or_no_sentinel_is_a_clear_error(
    replicated: ReplicatedRedis,
) -> None:
    hosts = ",".join(f"127.0.0.1:{p}" for p in replicated.sentinel_ports)
    for url, words in (
        (f"redis+sentinel://{hosts}/no-such-service", "no-such-service"),
        ("redis+sentinel://127.0.0.1:1,127.0.0.1:2/blprimary", "127.0.0.1:1"),
    ):
        settings = ProducerSettings(redis_url=url)
        client = connect(settings)
        try:
            with pytest.raises(RedisUnreachable, match=words) as caught:
                await wait_for_redis(client, settings, wait_s=0)
        finally:
            await client.aclose()
        assert "sentinel" in str(caught.value).lower()


async def test_a_replica_count_never_met_refuses_every_request(
    replicated: ReplicatedRedis, queue: str
) -> None:
    settings: dict[str, Any] = {
        "redis_url": replicated.url,
        "queue": queue,
        "durability": "replicated",
        "min_replicas": 3,  # there are two
        "replication_timeout_ms": 200,
    }
    async with AsyncProducer(**settings) as producer:
        with pytest.raises(NotReplicated) as caught:
            await producer.submit("never held as promised", request_id="r1")
        # How many of the two replicas confirmed within the 200 ms depends on when they ran
        # (none, on a busy machine): the message says how many did.
        assert 0 <= caught.value.confirmed <= 2
        assert f"{caught.value.confirmed} of the 3 replicas" in str(caught.value)
        assert caught.value.needed == 3
        with pytest.raises(NotReplicated):
            await producer.infer("nor this", timeout_s=5)
