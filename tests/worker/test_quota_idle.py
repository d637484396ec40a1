"""Idle mode with the fair share (docs/protocol.md, Tenants): a tenant's requests over its
quota are held under ``<tenant>~over`` and run only once no other tenant of their priority
is backlogged. Real Redis, a worker in this process (one request a batch, recording the
order). Needs the fair share's dispatch (batchline/transport/_fair.py): skipped where this
tree has none."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable
from pathlib import Path

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


async def test_traffic_over_quota_runs_after_every_other_tenants(
    start_worker: Callable[..., WorkerThread],
    configure: Configure,
    redis_url: str,
    queue: str,
    record_file: Path,
) -> None:
    configure("slow", TenantConfig(requests_per_min=1, over_quota="idle"))
    configure("busy", TenantConfig())
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        handles = [await producer.submit(f"slow{i}", tenant="slow") for i in range(3)]
        handles += [await producer.submit(f"busy{i}", tenant="busy") for i in range(4)]
        start_worker(spec("record_batches"), batch_size=1)  # all held before it admits
        outputs = await asyncio.gather(
            *(producer.result(h, timeout_s=RESULT_TIMEOUT_S) for h in handles)
        )
    assert outputs == [f"slow{i}" for i in range(3)] + [f"busy{i}" for i in range(4)]
    order = [x for batch in read_batches(record_file) for x in batch]
    assert set(order[-2:]) == {"slow1", "slow2"}, order  # over quota: last, yet run
