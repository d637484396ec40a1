"""The worker's per-tenant metrics on /metrics: a label per tenant for the busiest
``metrics_tenants``, the rest as ``other``, the same labels scrape after scrape; the queue's
per-tenant figures (backlog, in flight) beside what the worker answered. The requests are
added to the work stream as the admission's dispatch adds them (with ``tn``)."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable

import pytest
import redis

from batchline.keys import QueueKeys
from batchline.transport import usage_day
from batchline.worker import metrics as worker_metrics

from tests.support.service import WorkerThread, wait_until

N = 3
TENANTS = [f"t{i}" for i in range(N + 5)]
_SAMPLE = re.compile(r"^(batchline_tenant_\w+)\{(.*)\} ([0-9.e+-]+)$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """The per-tenant samples: family -> {labels: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', match.group(2))))
            samples[match.group(1)][labels] = float(match.group(3))
    return samples


def _by_tenant(samples: dict[tuple[tuple[str, str], ...], float]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for labels, value in samples.items():
        out[dict(labels)["tenant"]] += value
    return dict(out)


def _add(rclient: redis.Redis, keys: QueueKeys, tenant: str | None, n: int) -> None:
    for i in range(n):
        rid = f"{tenant}.{i}-{time.monotonic_ns()}" if tenant else f"plain-{i}"
        fields = {"v": "2", "id": rid, "meta": json.dumps("x"), "prio": "1"}
        fields["ts"] = str(time.time() * 1000)  # enqueued (unix ms), as producers write it
        if tenant:
            fields["tn"] = tenant
        rclient.xadd(keys.stream(1), fields)  # type: ignore[arg-type]


@pytest.mark.slow
def test_n_plus_5_tenants_show_n_labels_and_other_the_same_scrape_after_scrape(
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_metrics, "TENANT_REFRESH_S", 0.0)  # read with every heartbeat
    # Today's traffic so far: t7 the busiest, then t6, t5 (the queue's usage counters).
    day = keys.usage(usage_day(time.time()))
    rclient.hset(day, mapping={f"{t}|requests": 10 * (i + 1) for i, t in enumerate(TENANTS)})
    port = _free_port()
    worker = start_worker(metrics_port=port, metrics_tenants=N).worker
    chosen = ["t5", "t6", "t7"]
    wait_until(lambda: worker.metrics.labels.chosen == chosen, "the busiest tenants chosen")

    for tenant in TENANTS:
        _add(rclient, keys, tenant, 2)
    _add(rclient, keys, None, 1)
    total = 2 * len(TENANTS) + 1

    def answered() -> dict[str, float] | None:
        got = _by_tenant(_scrape(port)["batchline_tenant_requests_total"])
        return got if sum(got.values()) == total else None

    got = wait_until(answered, "every request counted")
    assert got == {"t5": 2, "t6": 2, "t7": 2, "other": 2 * (len(TENANTS) - N), "-": 1}
    served = _scrape(port)
    assert set(_by_tenant(served["batchline_tenant_wait_seconds_count"])) == set(got)
    assert _by_tenant(served["batchline_tenant_items_total"]) == got  # echo: 1 item each
    assert set(_by_tenant(served["batchline_tenant_tokens_total"])) == set(got)

    # The queue's figures: t0's backlog (no label: other) and t7's requests in flight.
    rclient.rpush(keys.backlog("t0", 1), b"held", b"held")
    rclient.zadd(keys.fair(1), {"t0": 1.0})
    rclient.zadd(keys.tenant_in_flight("t7"), {"t7.a": (time.time() + 600) * 1000})
    rclient.hset(day, mapping={"t7|refused": 4, "t1|refused": 3})  # the admission's today
    reads = worker.metrics.tenant_reads
    wait_until(lambda: worker.metrics.tenant_reads >= reads + 3, "three more reads")
    for _ in range(3):  # the same labels, read after read, scrape after scrape
        reads = worker.metrics.tenant_reads
        wait_until(lambda: worker.metrics.tenant_reads > reads, "another read")  # noqa: B023
        samples = _scrape(port)
        assert worker.metrics.labels.chosen == chosen
        assert set(_by_tenant(samples["batchline_tenant_requests_total"])) == set(got)
        assert samples["batchline_tenant_queued"] == {(("priority", "1"), ("tenant", "other")): 2}
        in_flight = _by_tenant(samples["batchline_tenant_in_flight"])
        assert in_flight == {"t5": 0, "t6": 0, "t7": 1, "other": 0, "-": 0}
        refused = _by_tenant(samples["batchline_tenant_refused_total"])
        assert (refused["t7"], refused["other"], refused.get("t5", 0)) == (4, 3, 0)
