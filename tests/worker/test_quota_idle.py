"""Idle mode (docs/protocol.md, Tenants): a tenant's requests over its quota are held under
``<tenant>~over`` and run only once nothing else waits, at any priority, with the fair share
on or off. Real Redis, a worker in this process (one request a batch, recording the
order). Needs the fair share's dispatch (batchline/transport/_fair.py): skipped where this
tree has none."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from batchline.producer import AsyncProducer
from batchline.tenants import TenantConfig

from tests.support.models_for_tests import read_batches
from tests.support.quota import Configure
from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, spec

if importlib.util.find_spec("batchline.transport._fair") is None:
    pytest.skip(
        "no fair share in this tree: held requests go straight through", allow_module_level=True
    )


@pytest.fixture
def record_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "batches.jsonl"
    monkeypatch.setenv("BLTEST_RECORD_FILE", str(path))
    return path


Serve = Callable[..., Awaitable[list[str]]]


@pytest.fixture
def serve(
    start_worker: Callable[..., WorkerThread],
    configure: Configure,
    redis_url: str,
    queue: str,
    record_file: Path,
) -> Serve:
    """``await serve(sent, **settings)``: tenant ``slow`` (1 request a minute, idle mode)
    and ``busy`` configured, ``sent`` ((value, tenant, priority) each) submitted while no
    worker runs, then a worker of ``settings`` (one request a batch) started; every value
    comes back; returns the order the model saw them."""
    configure("slow", TenantConfig(requests_per_min=1, over_quota="idle"))
    configure("busy", TenantConfig())

    async def run(sent: list[tuple[str, str | None, int | None]], **settings: Any) -> list[str]:
        async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
            handles = [
                await producer.submit(value, tenant=tenant, priority=priority)
                for value, tenant, priority in sent
            ]
            start_worker(spec("record_batches"), batch_size=1, **settings)  # all held first
            outputs = await asyncio.gather(
                *(producer.result(h, timeout_s=RESULT_TIMEOUT_S) for h in handles)
            )
        assert outputs == [value for value, _, _ in sent]
        return [x for batch in read_batches(record_file) for x in batch]

    return run


def sent(tenant: str, n: int, priority: int | None = None) -> list[tuple[str, str, int | None]]:
    return [(f"{tenant}{i}", tenant, priority) for i in range(n)]


async def test_traffic_over_quota_runs_after_every_other_tenants(serve: Serve) -> None:
    order = await serve(sent("slow", 3) + sent("busy", 4))
    assert set(order[-2:]) == {"slow1", "slow2"}, order  # over quota: last, yet run


async def test_traffic_over_quota_waits_without_the_fair_share_too(serve: Serve) -> None:
    """First come, first served (``fair_share`` off) serves within-quota traffic as it
    came; what is over quota still waits until nothing else does."""
    order = await serve(
        sent("slow", 3) + sent("busy", 4) + [("plain", None, None)], fair_share=False
    )
    within = [x for x in order if x != "plain"][:5]
    assert within == ["slow0", "busy0", "busy1", "busy2", "busy3"], order  # as they came
    assert set(order[-2:]) == {"slow1", "slow2"}, order


@pytest.mark.parametrize("fair_share", [True, False])
async def test_traffic_over_quota_at_a_higher_priority_waits_for_every_priority(
    serve: Serve, fair_share: bool
) -> None:
    """Over quota is below everyone's traffic, whatever its priority: a tenant over its
    quota at priority 2 runs after another's requests at priority 1 (within its quota, it
    goes first: priorities come first)."""
    order = await serve(sent("slow", 3, 2) + sent("busy", 4, 1), fair_share=fair_share)
    assert order[0] == "slow0", order
    assert set(order[-2:]) == {"slow1", "slow2"}, order
