"""Accounting at completion (docs/protocol.md, Tenants: Quotas), by a real worker process on
a real Redis: every way a tenant's request ends releases its in-flight slot, its tokens are
corrected by the real cost, and what was served is counted in the day's usage (the
untenanted as ``-``). The entries are added as the admission's dispatch adds them (with
``tn`` and ``cost``), with their in-flight slots taken as the admission takes them."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
import redis

from batchline.keys import QueueKeys
from batchline.tenants import TenantConfig
from batchline.transport import usage_day

from tests.support.service import WorkerProcess, spec, wait_until

pytestmark = pytest.mark.slow


def _entry(rid: str, value: object, **more: str) -> dict[str, str | bytes]:
    fields: dict[str, str | bytes] = {"v": "2", "id": rid, "meta": json.dumps(value), "prio": "1"}
    fields.update(more)
    return fields


def _minute(rclient: redis.Redis) -> int:
    s, us = rclient.time()
    return int((s * 1000 + us // 1000) // 60000)


def test_every_ending_releases_the_slot_corrects_tokens_and_counts_usage(
    spawn_worker: Callable[..., WorkerProcess], rclient: redis.Redis, keys: QueueKeys
) -> None:
    tenant = "acme"
    rclient.hset(keys.tenants, tenant, TenantConfig(tokens_per_min=10_000).to_json())
    past_ms = str(int(time.time() * 1000) - 60_000)
    endings = {
        "acme.ok": _entry("acme.ok", "fine", tn=tenant, cost="50"),
        "acme.error": _entry("acme.error", "poison", tn=tenant, cost="50"),
        "acme.expired": _entry("acme.expired", "late", tn=tenant, cost="50", dl=past_ms),
        "acme.cancelled": _entry("acme.cancelled", "gone", tn=tenant, cost="50"),
        "acme.dead": _entry("acme.dead", "old", tn=tenant, cost="50", v="1"),
        "plain": _entry("plain", "x"),
    }
    minute = _minute(rclient)
    counter = keys.quota(tenant, "t", minute)
    rclient.set(counter, 250, ex=120)  # the five estimates, as admitted
    expiry = (int(time.time()) + 3600) * 1000
    rclient.zadd(keys.tenant_in_flight(tenant), dict.fromkeys(list(endings)[:5], expiry))
    for fields in endings.values():
        rclient.xadd(keys.stream(1), fields)  # type: ignore[arg-type]
    rclient.xadd(keys.cancels, {"id": "acme.cancelled"})
    spawn_worker(spec("poison"), batch_size=1)
    wait_until(lambda: all(rclient.exists(keys.result(r)) for r in endings), "every answer")

    statuses = {}
    for rid in endings:
        raw = rclient.get(keys.result(rid))
        assert raw is not None
        statuses[rid] = raw
    assert b"cancelled" in statuses["acme.cancelled"]
    assert b"expired" in statuses["acme.expired"]
    assert b"MalformedRequest" in statuses["acme.dead"]
    assert b"ValueError" in statuses["acme.error"]
    assert rclient.zcard(keys.tenant_in_flight(tenant)) == 0
    # ok: 1 item (a batch function's request is one) against 50 estimated; expired and
    # cancelled: never ran (0); the error and the dead letter keep their estimate. (Summed
    # over the minute and the next: a minute may turn meanwhile.)
    total = sum(int(rclient.get(keys.quota(tenant, "t", m)) or 0) for m in (minute, minute + 1))
    assert total == 250 - 49 - 50 - 50
    usage = rclient.hgetall(keys.usage(usage_day(time.time())))
    assert usage[b"acme|requests"] == b"1"
    assert usage[b"acme|items"] == b"1"
    assert usage[b"-|requests"] == b"1"
    assert usage[b"-|items"] == b"1"
    assert 0 < rclient.ttl(keys.usage(usage_day(time.time()))) <= 62 * 86400
