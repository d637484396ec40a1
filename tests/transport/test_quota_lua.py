"""The quota pieces in Lua (batchline/transport/_quota.py) on a real Redis 7, called from a
script that holds them as the queue's functions and the completion script do: the
admission's hook (its check and counts), the enqueue function's read-only look, idle mode,
and the accounting at completion (in-flight released, tokens corrected, usage counted)."""

from __future__ import annotations

import json

import msgpack
import pytest
import redis

from batchline.codec import Limits, unpack_result
from batchline.errors import QuotaExceeded
from batchline.keys import QueueKeys
from batchline.tenants import TenantConfig
from batchline.transport import once_keys
from batchline.transport._lua import ONCE, REPLIES, TENANTS
from batchline.transport._quota import ACCOUNT, COUNTERS, QUOTA, usage_day

from tests.support.quota import redis_minute, within_one_minute
from tests.support.service import admit_inbox

# ARGV: 1, 2 unused; 3-11 begin_once's; 12 the queue's key base; then the call's own.
_ADMIT = (
    REPLIES
    + ONCE
    + TENANTS
    + COUNTERS
    + QUOTA
    + r"""
begin_once(ARGV)
begin_tenants(ARGV[12])
local got = quota_admit(ARGV[13], ARGV[14], tonumber(ARGV[15]), tenant_config(ARGV[13]))
quota_end()
if type(got) == 'table' then return {got.limit, got.retry_ms, got.message} end
return got or ''
"""
)
_PEEK = (
    TENANTS
    + COUNTERS
    + QUOTA
    + r"""
begin_tenants(ARGV[1])
return quota_peek(ARGV[2], tonumber(ARGV[3]), tenant_config(ARGV[2]))
"""
)
_ACCOUNT = (
    TENANTS
    + COUNTERS
    + ACCOUNT
    + r"""
begin_tenants(ARGV[1])
account_begin(ARGV[2], tonumber(ARGV[3]))
account(ARGV[4], cmsgpack.unpack(ARGV[5]), true)
account_end()
"""
)


@pytest.fixture(autouse=True)
def one_minute(rclient: redis.Redis) -> None:
    """Each test's counts in one of Redis's minutes."""
    within_one_minute(rclient, 5)


@pytest.fixture
def admit(rclient: redis.Redis, keys: QueueKeys):  # type: ignore[no-untyped-def]
    def call(tenant: str, rid: str, cost: int = 1) -> object:
        args = [0, "", 60, 0, *once_keys(keys), keys.base_prefix, tenant, rid, cost]
        got = rclient.eval(_ADMIT, 0, *args)
        if isinstance(got, list):
            return [x.decode() if isinstance(x, bytes) else x for x in got]
        return got.decode()

    return call


def configure(rclient: redis.Redis, keys: QueueKeys, tenant: str, **limits: object) -> None:
    rclient.hset(keys.tenants, tenant, TenantConfig(**limits).to_json())  # type: ignore[arg-type]


def test_requests_per_minute_refuse_naming_the_limit_and_the_next_minute(
    rclient: redis.Redis, keys: QueueKeys, admit
) -> None:
    configure(rclient, keys, "acme", requests_per_min=2)
    assert admit("acme", "acme.1") == ""
    assert admit("acme", "acme.2") == ""
    limit, retry_ms, message = admit("acme", "acme.3")
    assert limit == "requests_per_min"
    assert 0 < retry_ms <= 60_000
    assert message.startswith("tenant acme: requests_per_min=2 reached")
    assert rclient.zcard(keys.tenant_in_flight("acme")) == 2
    # another tenant, and a tenant without a config, are not limited by acme's count
    assert admit("other", "other.1") == ""
    configure(rclient, keys, "b", requests_per_min=1)
    assert admit("b", "b.1") == ""


def test_tokens_per_minute_count_the_estimate(rclient: redis.Redis, keys: QueueKeys, admit) -> None:
    configure(rclient, keys, "acme", tokens_per_min=100)
    assert admit("acme", "acme.1", cost=500) == ""  # alone larger than the limit: admitted
    assert admit("acme", "acme.2", cost=1)[0] == "tokens_per_min"
    rclient.set(keys.quota("acme", "t", redis_minute(rclient)), 60)
    assert admit("acme", "acme.3", cost=41)[0] == "tokens_per_min"  # 60 + 41 > 100
    assert admit("acme", "acme.4", cost=40) == ""
    assert int(rclient.get(keys.quota("acme", "t", redis_minute(rclient)))) == 100


def test_in_flight_is_pruned_by_expiry(rclient: redis.Redis, keys: QueueKeys, admit) -> None:
    configure(rclient, keys, "acme", max_in_flight=1)
    assert admit("acme", "acme.1") == ""
    assert admit("acme", "acme.2")[:2] == ["max_in_flight", 1000]
    rclient.zadd(keys.tenant_in_flight("acme"), {"acme.1": 1})  # its answer lost: expired
    assert admit("acme", "acme.3") == ""


def test_idle_mode_holds_over_quota_under_the_pseudo_tenant(
    rclient: redis.Redis, keys: QueueKeys, admit
) -> None:
    configure(rclient, keys, "acme", requests_per_min=1, over_quota="idle")
    assert admit("acme", "acme.1") == ""
    assert admit("acme", "acme.2") == "acme~over"
    assert rclient.zrange(keys.tenant_in_flight("acme"), 0, -1) == [b"acme.1"]


def test_the_producer_look_reads_only(rclient: redis.Redis, keys: QueueKeys, admit) -> None:
    configure(rclient, keys, "acme", requests_per_min=1)

    def peek(tenant: str) -> object:
        return rclient.eval(_PEEK, 0, keys.base_prefix, tenant, 1)

    assert peek("acme") is None
    admit("acme", "acme.1")
    retry_ms, limit = peek("acme")  # type: ignore[misc]
    assert limit == b"requests_per_min"
    assert 0 < retry_ms <= 60_000
    configure(rclient, keys, "idle", requests_per_min=1, over_quota="idle")
    admit("idle", "idle.1")
    assert peek("idle") is None  # idle mode: held, never refused


def test_accounting_releases_corrects_and_counts(
    rclient: redis.Redis, keys: QueueKeys, admit
) -> None:
    configure(rclient, keys, "acme", tokens_per_min=1000)
    admit("acme", "acme.1", cost=300)
    now_minute = redis_minute(rclient)
    usage = keys.usage(usage_day(now_minute * 60))

    def account(rid: str, tenant: str, estimate: int, real: int, items: int, tokens: int) -> None:
        a = msgpack.packb([tenant, estimate, real, items, tokens, 1])
        rclient.eval(_ACCOUNT, 0, keys.base_prefix, usage, 86400, rid, a)

    account("acme.1", "acme", 300, 120, 1, 120)
    assert rclient.zcard(keys.tenant_in_flight("acme")) == 0
    assert int(rclient.get(keys.quota("acme", "t", now_minute))) == 120
    account("x", "", 0, -1, 3, 9)
    assert rclient.hgetall(usage) == {
        b"acme|requests": b"1",
        b"acme|items": b"1",
        b"acme|tokens": b"120",
        b"-|requests": b"1",
        b"-|items": b"3",
        b"-|tokens": b"9",
    }
    assert 0 < rclient.ttl(usage) <= 86400


# -- through the queue's functions: the admission of a tenant's inbox --------------------------


def _element(rid: str, cost: int) -> bytes:
    meta = json.dumps("x")
    fields = ["v", "2", "id", rid, "meta", meta, "reply", "acme.me", "cost", str(cost)]
    packed: bytes = msgpack.packb(["r", 1, *fields], use_bin_type=False)
    return packed


def test_the_admission_refuses_over_quota_as_the_requests_result(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    """A tenant's requests past its requests per minute get a QuotaExceeded result (its
    retry time, its limit), stored and pushed, their ids free to run again; the admitted
    ones are held, each in flight."""
    configure(rclient, keys, "acme", requests_per_min=2)
    rclient.rpush(keys.tenant_inbox("acme"), *(_element(f"acme.{i}", 5) for i in range(3)))
    rclient.rpush(keys.wakes, msgpack.packb(["t", "acme"]))
    admit_inbox(rclient, keys)
    held = int(rclient.hget(keys.backlog_counts, "1") or 0)
    assert (rclient.xlen(keys.stream(1)), held) == (1, 1)  # one dispatched, one held
    assert rclient.zcard(keys.tenant_in_flight("acme")) == 2
    result = unpack_result(rclient.get(keys.result("acme.2")), Limits())
    assert result.error_type == "QuotaExceeded"
    assert 0 < result.retry_ms <= 60_000
    with pytest.raises(QuotaExceeded) as caught:
        result.unwrap()
    assert caught.value.tenant == "acme"
    assert caught.value.limit == "requests_per_min"
    assert caught.value.retry_after_s == result.retry_ms / 1000
    assert rclient.get(keys.request_input("acme.2")).endswith(b" !")  # runs again later
    ((_, reply),) = rclient.xrange(keys.reply("acme.me"))
    assert reply[b"n"] == b"1"


def test_a_request_answered_twice_is_counted_once(rclient: redis.Redis, keys: QueueKeys) -> None:
    """The completion script counts a record's usage only where its acknowledgement took:
    the same entry answered again (another worker that reclaimed it, or a call made again
    after a failover) adds nothing to the day's usage."""
    from batchline.codec._results import pack_result, result_fields
    from batchline.keys import GROUP
    from batchline.transport import COMPLETE

    stream = keys.stream(1)
    rclient.xgroup_create(stream, GROUP, id="0", mkstream=True)
    entry = rclient.xadd(stream, {"v": "2", "id": "acme.1", "tn": "acme", "cost": "5"})
    rclient.xreadgroup(GROUP, "w1", {stream: ">"})
    result = pack_result(result_fields("acme.1", "ok", "x", "", "", 1.0, 1, 1.0, "w1"))
    account = ["acme", 5, 3, 1, 3, 1]  # estimated 5, real 3, 1 item, 3 tokens, served ok
    record = [1, entry.decode(), "acme.1", "", result, 6, "", "", "", "ok", [], account]
    usage = keys.usage(usage_day(rclient.time()[0]))
    script = rclient.register_script(COMPLETE)

    def complete(again: str) -> int:
        args = [
            GROUP, 60, 1000, 1000, keys.result_prefix, keys.reply_prefix,
            msgpack.packb(record, use_bin_type=False), keys.request_input(""),
            keys.waiters(""), 0, 0, "0", again, usage, 86400, keys.base_prefix,
        ]  # fmt: skip
        return int(script(keys=[*keys.streams_low_first, keys.dead], args=args))

    assert complete("0") == 1
    counted = rclient.hgetall(usage)
    assert counted == {b"acme|requests": b"1", b"acme|items": b"1", b"acme|tokens": b"3"}
    for again in ("1", "0"):  # after a failover; another worker's answer
        complete(again)
        assert rclient.hgetall(usage) == counted
