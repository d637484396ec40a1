"""A tenant's quotas through the producer (docs/protocol.md, Tenants: Quotas): real Redis 7, a
real worker process that mirrors the tenants' configs from the tenant store and admits. Two
producers (two API replicas) share one count; a request over quota raises QuotaExceeded with
its retry time, refused at once or as the request's result; in idle mode, traffic over quota
is held, not refused, and runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import redis

from batchline.errors import QuotaExceeded
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer, Producer
from batchline.tenants import TenantConfig

from tests.support.models_for_tests import GatedModel
from tests.support.quota import Configure, within_one_minute
from tests.support.service import RESULT_TIMEOUT_S, WorkerProcess, WorkerThread

pytestmark = pytest.mark.slow

T = RESULT_TIMEOUT_S


async def test_requests_per_minute_hold_across_two_producers(
    spawn_worker: Callable[..., WorkerProcess],
    rclient: redis.Redis,
    configure: Configure,
    keys: QueueKeys,
    redis_url: str,
    queue: str,
) -> None:
    spawn_worker()
    configure("acme", TenantConfig(requests_per_min=3), wait=True)
    within_one_minute(rclient)
    settings = {"redis_url": redis_url, "queue": queue, "tenant": "acme"}
    async with AsyncProducer(**settings) as a, AsyncProducer(**settings) as b:
        assert await a.infer("1", timeout_s=T) == "1"
        assert await b.infer("2", timeout_s=T) == "2"
        assert await a.infer("3", timeout_s=T) == "3"
        # the fourth, from either, is refused at once: nothing queued
        for producer in (b, a):
            with pytest.raises(QuotaExceeded) as caught:
                await producer.submit("4")
            refused = caught.value
            assert (refused.tenant, refused.limit) == ("acme", "requests_per_min")
            assert 0 < refused.retry_after_s <= 60
            assert "tenant acme: requests_per_min" in str(refused)
        # another tenant has its own count
        assert await a.infer("x", tenant="other", timeout_s=T) == "x"
    assert rclient.zcard(keys.tenant_in_flight("acme")) == 0  # every answer released its slot


async def test_the_admission_refuses_what_the_producers_look_let_through(
    spawn_worker: Callable[..., WorkerProcess],
    rclient: redis.Redis,
    configure: Configure,
    keys: QueueKeys,
    redis_url: str,
    queue: str,
) -> None:
    """Five requests in one write: the enqueue function's look finds room for all, the
    admission admits two; the other three get a QuotaExceeded result, with its retry time."""
    spawn_worker()
    configure("acme", TenantConfig(requests_per_min=2), wait=True)
    within_one_minute(rclient)
    async with AsyncProducer(redis_url=redis_url, queue=queue, tenant="acme") as producer:
        outcomes = await asyncio.gather(
            *(producer.infer(str(i), timeout_s=T) for i in range(5)), return_exceptions=True
        )
    refused = [o for o in outcomes if isinstance(o, QuotaExceeded)]
    assert len(refused) == 3, outcomes
    for exc in refused:
        assert exc.limit == "requests_per_min"
        assert exc.tenant == "acme"
        assert 0 < exc.retry_after_s <= 60
    assert len([o for o in outcomes if isinstance(o, str)]) == 2


def test_the_sync_producer_raises_quota_exceeded_for_requests_in_flight(
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    configure: Configure,
    keys: QueueKeys,
    redis_url: str,
    queue: str,
) -> None:
    gate = GatedModel()
    start_worker(gate, batch_size=1)
    configure("acme", TenantConfig(max_in_flight=1), wait=True)
    with Producer(redis_url=redis_url, queue=queue, tenant="acme") as producer:
        first = producer.submit("first")
        assert gate.entered.wait(T)  # admitted, running: in flight
        with pytest.raises(QuotaExceeded) as caught:
            producer.infer("second", timeout_s=T)
        assert caught.value.limit == "max_in_flight"
        assert caught.value.retry_after_s == 1.0
        gate.release.set()
        assert producer.result(first, timeout_s=T) == "first"
        assert producer.infer("third", timeout_s=T) == "third"  # its slot was released


async def test_idle_mode_runs_traffic_over_quota_instead_of_refusing_it(
    spawn_worker: Callable[..., WorkerProcess],
    rclient: redis.Redis,
    configure: Configure,
    keys: QueueKeys,
    redis_url: str,
    queue: str,
) -> None:
    spawn_worker()
    configure("acme", TenantConfig(requests_per_min=1, over_quota="idle"), wait=True)
    async with AsyncProducer(redis_url=redis_url, queue=queue, tenant="acme") as producer:
        answers = await asyncio.gather(*(producer.infer(str(i), timeout_s=T) for i in range(4)))
    assert answers == ["0", "1", "2", "3"]
