"""The quota pieces in Lua (batchline/transport/_quota.py) on a real Redis 7, called from a
script that holds them as the queue's functions and the completion script do: the
admission's check and counts, the enqueue function's read-only check, idle mode, and the
accounting at completion (in-flight released, tokens corrected, usage counted)."""

from __future__ import annotations

import msgpack
import pytest
import redis

from batchline.keys import QueueKeys
from batchline.tenants import TenantConfig
from batchline.transport import input_hash, once_keys
from batchline.transport._lua import ONCE, REPLIES
from batchline.transport._quota import ACCOUNT, COUNTERS, QUOTA, quota_args, usage_day

# ARGV: 1, 2 unused; 3-11 begin_once's; 12-14 quota_begin's; then the call's own.
_ADMIT = (
    REPLIES
    + ONCE
    + COUNTERS
    + QUOTA
    + r"""
begin_once(ARGV)
quota_begin(ARGV[12], ARGV[13], ARGV[14])
local refused, hold = quota_admit(ARGV[15], ARGV[16], ARGV[17], ARGV[18], tonumber(ARGV[19]))
send_replies(ARGV[20], 1000, ttl)
return {refused and 1 or 0, hold or ''}
"""
)
_CHECK = (
    REPLIES
    + ONCE
    + COUNTERS
    + QUOTA
    + r"""
quota_begin(ARGV[1], ARGV[2], ARGV[3])
return quota_check(ARGV[4], tonumber(ARGV[5]))
"""
)
_ACCOUNT = (
    COUNTERS
    + ACCOUNT
    + r"""
quota_begin(ARGV[1], ARGV[2], ARGV[3])
account_begin(ARGV[4], tonumber(ARGV[5]))
account(ARGV[6], cmsgpack.unpack(ARGV[7]), true)
account_end()
"""
)

H = input_hash(b'"x"', b"")


@pytest.fixture
def admit(rclient: redis.Redis, keys: QueueKeys):  # type: ignore[no-untyped-def]
    def call(tenant: str, rid: str, cost: int = 1, reply: str = "") -> tuple[int, str]:
        args = [0, "", 60, 0, *once_keys(keys), *quota_args(keys), tenant, rid, reply, H, cost]
        refused, hold = rclient.eval(_ADMIT, 0, *args, keys.reply_prefix)
        return refused, hold.decode()

    return call


def configure(rclient: redis.Redis, keys: QueueKeys, tenant: str, **limits: object) -> None:
    rclient.hset(keys.tenants, tenant, TenantConfig(**limits).to_json())  # type: ignore[arg-type]


def minute(rclient: redis.Redis) -> int:
    s, us = rclient.time()
    return (s * 1000 + us // 1000) // 60000


def test_requests_per_minute_refuse_with_a_result_like_a_full_queue(
    rclient: redis.Redis, keys: QueueKeys, admit
) -> None:
    configure(rclient, keys, "acme", requests_per_min=2)
    assert admit("acme", "acme.1") == (0, "")
    assert admit("acme", "acme.2") == (0, "")
    assert admit("acme", "acme.3", reply="acme.me") == (1, "")
    flat = msgpack.unpackb(rclient.get(keys.result("acme.3")), raw=False)
    got = dict(zip(flat[::2], flat[1::2], strict=True))
    assert got["etype"] == "QuotaExceeded"
    assert got["ih"] == H
    assert got["emsg"].startswith("tenant acme: requests_per_min=2 reached")
    assert 0 < int(got["retry_ms"]) <= 60_000
    assert rclient.get(keys.request_input("acme.3")) == f"{H} !".encode()  # runs again
    assert rclient.xlen(keys.reply("acme.me")) == 1
    assert rclient.zcard(keys.tenant_in_flight("acme")) == 2
    # another tenant, and a tenant without a config, are not limited by acme's count
    assert admit("other", "other.1") == (0, "")
    configure(rclient, keys, "b", requests_per_min=1)
    assert admit("b", "b.1") == (0, "")


def test_tokens_per_minute_count_the_estimate(rclient: redis.Redis, keys: QueueKeys, admit) -> None:
    configure(rclient, keys, "acme", tokens_per_min=100)
    assert admit("acme", "acme.1", cost=500)[0] == 0  # alone larger than the limit: admitted
    assert admit("acme", "acme.2", cost=1)[0] == 1
    rclient.set(keys.quota("acme", "t", minute(rclient)), 60)
    assert admit("acme", "acme.3", cost=41)[0] == 1  # 60 + 41 > 100
    assert admit("acme", "acme.4", cost=40)[0] == 0
    assert int(rclient.get(keys.quota("acme", "t", minute(rclient)))) == 100


def test_in_flight_is_pruned_by_expiry(rclient: redis.Redis, keys: QueueKeys, admit) -> None:
    configure(rclient, keys, "acme", max_in_flight=1)
    assert admit("acme", "acme.1") == (0, "")
    assert admit("acme", "acme.2")[0] == 1
    flat = msgpack.unpackb(rclient.get(keys.result("acme.2")), raw=False)
    assert dict(zip(flat[::2], flat[1::2], strict=True))["retry_ms"] == "1000"
    rclient.zadd(keys.tenant_in_flight("acme"), {"acme.1": 1})  # its answer lost: expired
    assert admit("acme", "acme.3") == (0, "")


def test_idle_mode_holds_over_quota_under_the_pseudo_tenant(
    rclient: redis.Redis, keys: QueueKeys, admit
) -> None:
    configure(rclient, keys, "acme", requests_per_min=1, over_quota="idle")
    assert admit("acme", "acme.1") == (0, "")
    assert admit("acme", "acme.2") == (0, "acme~over")
    assert rclient.get(keys.result("acme.2")) is None
    assert rclient.zrange(keys.tenant_in_flight("acme"), 0, -1) == [b"acme.1"]


def test_the_producer_check_reads_only(rclient: redis.Redis, keys: QueueKeys, admit) -> None:
    configure(rclient, keys, "acme", requests_per_min=1)

    def check(tenant: str) -> object:
        return rclient.eval(_CHECK, 0, *quota_args(keys), tenant, 1)

    assert check("acme") is None
    admit("acme", "acme.1")
    retry_ms, limit = check("acme")[1:]  # type: ignore[index]
    assert limit == b"requests_per_min"
    assert 0 < retry_ms <= 60_000
    configure(rclient, keys, "idle", requests_per_min=1, over_quota="idle")
    admit("idle", "idle.1")
    assert check("idle") is None  # idle mode: held, never refused


def test_accounting_releases_corrects_and_counts(
    rclient: redis.Redis, keys: QueueKeys, admit
) -> None:
    configure(rclient, keys, "acme", tokens_per_min=1000)
    admit("acme", "acme.1", cost=300)
    now_minute = minute(rclient)
    day = usage_day(now_minute * 60)
    usage = keys.usage(day)

    def account(rid: str, tenant: str, estimate: int, real: int, items: int, tokens: int) -> None:
        a = msgpack.packb([tenant, estimate, real, items, tokens, 1])
        rclient.eval(_ACCOUNT, 0, *quota_args(keys), usage, 86400, rid, a)

    account("acme.1", "acme", 300, 120, 1, 120)
    assert rclient.zcard(keys.tenant_in_flight("acme")) == 0
    if minute(rclient) == now_minute:  # (a minute's turn between the two is no failure)
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
