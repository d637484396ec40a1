"""Accounting at completion (docs/protocol.md, Tenants: Quotas), by a real worker process on
a real Redis: every way a tenant's request ends releases its in-flight slot, its tokens are
corrected by the real cost, and what was served is counted in the day's usage (the
untenanted as ``-``). The entries are added as the admission's dispatch adds them (with
``tn`` and ``cost``), with their in-flight slots taken as the admission takes them."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable

import pytest
import redis

from batchline.codec import Request
from batchline.errors import QuotaExceeded
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer
from batchline.tenants import TenantConfig
from batchline.transport import usage_day
from batchline.worker.serving._answers import accounted, billed
from batchline.worker.shared._held import Meta

from tests.support.quota import Configure, redis_minute, within_one_minute
from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerProcess,
    WorkerThread,
    spec,
    wait_until,
)


def _entry(rid: str, value: object, **more: str) -> dict[str, str | bytes]:
    fields: dict[str, str | bytes] = {"v": "2", "id": rid, "meta": json.dumps(value), "prio": "1"}
    fields.update(more)
    return fields


@pytest.mark.slow
def test_every_ending_releases_the_slot_corrects_tokens_and_counts_usage(
    spawn_worker: Callable[..., WorkerProcess],
    rclient: redis.Redis,
    keys: QueueKeys,
    configure: Configure,
) -> None:
    tenant = "acme"
    configure(tenant, TenantConfig(tokens_per_min=10_000))
    past_ms = str(int(time.time() * 1000) - 60_000)
    endings = {
        "acme.ok": _entry("acme.ok", "fine", tn=tenant, cost="50"),
        "acme.error": _entry("acme.error", "poison", tn=tenant, cost="50"),
        "acme.expired": _entry("acme.expired", "late", tn=tenant, cost="50", dl=past_ms),
        "acme.cancelled": _entry("acme.cancelled", "gone", tn=tenant, cost="50"),
        "acme.dead": _entry("acme.dead", "old", tn=tenant, cost="50", v="1"),
        "plain": _entry("plain", "x"),
    }
    within_one_minute(rclient, 30)
    minute = redis_minute(rclient)
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
    # cancelled: never ran (0); the error and the dead letter keep their estimate.
    total = int(rclient.get(keys.quota(tenant, "t", minute)) or 0)
    assert total == 250 - 49 - 50 - 50
    usage = rclient.hgetall(keys.usage(usage_day(time.time())))
    assert usage[b"acme|requests"] == b"1"
    assert usage[b"acme|items"] == b"1"
    assert usage[b"-|requests"] == b"1"
    assert usage[b"-|items"] == b"1"
    assert 0 < rclient.ttl(keys.usage(usage_day(time.time()))) <= 62 * 86400


def _meta(request: Request, items: int = 0, tokens: int = 0) -> Meta:
    return Meta(1, b"1-0", request, None, 0.0, items=items, tokens=tokens)


def test_the_real_cost_of_each_kind_of_answer() -> None:
    """A generation's real cost is its prompt and generated tokens; an embedding's its
    items; a request that never ran costs nothing; an error keeps its estimate."""
    ours = Request(v=2, id="acme.1", meta=b"null", tenant="acme", cost=300)
    generated = {"text": "hi", "tokens": 12, "prompt_tokens": 30, "finish_reason": "eos"}
    assert accounted(_meta(ours, items=1), "ok", generated) == ["acme", 300, 42, 1, 42, 1]
    assert accounted(_meta(ours, items=3, tokens=17), "ok", [0.1]) == ["acme", 300, 3, 3, 17, 1]
    assert accounted(_meta(ours), "cancelled", None) == ["acme", 300, 0, 0, 0, 0]
    assert accounted(_meta(ours), "expired", None) == ["acme", 300, 0, 0, 0, 0]
    assert accounted(_meta(ours), "error", None) == ["acme", 300, -1, 0, 0, 0]
    plain = Request(v=2, id="x", meta=b"null")
    assert accounted(_meta(plain, items=2), "ok", "out") == ["", 1, 2, 2, 0, 1]
    assert accounted(_meta(plain), "error", None) is None  # nothing to account
    assert billed({b"tn": b"acme", b"cost": b"7"}) == ("acme", 7)
    assert billed({b"tn": b"a.b", b"cost": b"99999999"}) == ("", 1)


@pytest.mark.slow
async def test_the_refusals_counted_expire_as_the_workers_usage_ttl_days_say(
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    configure: Configure,
    redis_url: str,
    queue: str,
) -> None:
    """The day's usage key that counts the admission's refusals over a quota expires
    ``usage_ttl_days`` after that write, as it does after the completion's (not a default of
    its own), even before anything is served that day."""
    configure("acme", TenantConfig(requests_per_min=1))
    within_one_minute(rclient, 30)
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        # Sent before any worker admits: the enqueue function's look counts nothing yet.
        handles = [await producer.submit(f"x{i}", tenant="acme") for i in range(3)]
        # The minute's request used meanwhile (another replica's): all three are refused,
        # nothing is served (whose accounting would set the TTL too).
        rclient.set(keys.quota("acme", "r", redis_minute(rclient)), 1, ex=120)
        day = keys.usage(usage_day(time.time()))
        start_worker(spec("echo"), usage_ttl_days=1, max_queue_depth=0)
        for handle in handles:
            with contextlib.suppress(QuotaExceeded):
                await producer.result(handle, timeout_s=RESULT_TIMEOUT_S)
    assert rclient.hget(day, "acme|refused") == b"3"
    assert rclient.hget(day, "acme|requests") is None
    assert 0 < rclient.ttl(day) <= 86400
