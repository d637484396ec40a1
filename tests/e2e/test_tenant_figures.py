"""End to end: tenants' requests through producers, a real worker and Redis, then read back
as an operator reads them: ``batchline usage``, ``batchline status --by-tenant`` and the
worker's per-tenant metrics."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
from collections.abc import Callable

import pytest

from batchline.producer import AsyncProducer
from batchline.transport import usage_day

from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, run_cli, wait_until

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


async def test_usage_status_and_metrics_show_what_each_tenant_was_served(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str
) -> None:
    port = _free_port()
    worker = start_worker(metrics_port=port).worker
    sent = {"acme": 3, "globex": 2}
    for tenant, n in sent.items():
        async with AsyncProducer(redis_url=redis_url, queue=queue, tenant=tenant) as producer:
            for i in range(n):
                assert await producer.infer(f"{tenant} {i}", timeout_s=RESULT_TIMEOUT_S)
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        assert await producer.infer("untenanted", timeout_s=RESULT_TIMEOUT_S)

    env = {"BATCHLINE_REDIS_URL": redis_url, "BATCHLINE_QUEUE": queue}
    done = run_cli("usage", "--json", env=env)
    assert done.returncode == 0, done.stderr
    usage = json.loads(done.stdout)
    rows = {r["tenant"]: (r["day"], r["requests"], r["items"]) for r in usage["days"]}
    # Counted by the completion that wrote each answer: in place once infer() returned.
    day = rows["acme"][0]
    assert day in (usage_day(time.time()), usage_day(time.time() - 60))  # unless midnight
    assert rows == {"-": (day, 1, 1), "acme": (day, 3, 3), "globex": (day, 2, 2)}

    done = run_cli("status", "--by-tenant", "--json", env=env)
    assert done.returncode == 0, done.stderr
    tenants = {t["tenant"]: t for t in json.loads(done.stdout)["tenants"]}
    assert {t: f["requests_today"] for t, f in tenants.items()} == {"-": 1, **sent}
    assert all(f["in_flight"] == 0 and f["queued"] == 0 for f in tenants.values())

    # The worker gives the tenants labels as it reads the queue's counters (its heartbeat);
    # what it answered before counts as other. Then each tenant's answers show as its own.
    wait_until(lambda: worker.metrics.labels.chosen == ["acme", "globex"], "labels chosen")
    for tenant in sent:
        async with AsyncProducer(redis_url=redis_url, queue=queue, tenant=tenant) as producer:
            assert await producer.infer("once more", timeout_s=RESULT_TIMEOUT_S)
    text = await asyncio.to_thread(_scrape, port)
    for tenant in sent:
        assert f'batchline_tenant_requests_total{{status="ok",tenant="{tenant}"}}' in text
    assert 'batchline_tenant_in_flight{tenant="acme"} 0.0' in text
