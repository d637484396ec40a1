"""The admission counts each request it refuses over a quota in the day's usage hash
(``<tenant>|refused``: docs/protocol.md, Tenants), which ``batchline usage``, ``batchline
status --by-tenant`` and the metrics read; its day is the UTC day of Redis's clock, named as
the workers name the day of what they served."""

from __future__ import annotations

import calendar

import pytest
import redis

from batchline.keys import QueueKeys
from batchline.tenants import TenantConfig
from batchline.transport import once_keys
from batchline.transport._lua import ONCE, REPLIES, TENANTS
from batchline.transport._quota import COUNTERS, QUOTA, USAGE_TTL_DAYS, usage_day

_DAY = TENANTS + COUNTERS + "return quota_day(tonumber(ARGV[1]))"
_ADMIT = (
    REPLIES
    + ONCE
    + TENANTS
    + COUNTERS
    + QUOTA
    + r"""
begin_once(ARGV)
begin_tenants(ARGV[12])
local got = quota_admit(ARGV[13], ARGV[14], 1, tenant_config(ARGV[13]))
return type(got) == 'table' and got.limit or ''
"""
)


def _unix(y: int, m: int, d: int, hh: int = 0, mm: int = 0, ss: int = 0) -> int:
    return calendar.timegm((y, m, d, hh, mm, ss, 0, 0, 0))


@pytest.mark.parametrize(
    "unix_s",
    [
        0,
        _unix(1999, 12, 31, 23, 59, 59),
        _unix(2000, 2, 29, 12),
        _unix(2000, 3, 1),
        _unix(2024, 2, 29, 23, 59, 59),
        _unix(2026, 11, 28, 11, 30),
        _unix(2026, 12, 31, 23, 59, 59),
        _unix(2100, 2, 28, 23, 59, 59),
        _unix(2100, 3, 1),
    ],
)
def test_the_lua_day_is_the_workers_usage_day(rclient: redis.Redis, unix_s: int) -> None:
    for ms in (unix_s * 1000, unix_s * 1000 + 999):
        assert rclient.eval(_DAY, 0, ms).decode() == usage_day(ms / 1000)


def test_every_refusal_over_a_quota_counts_in_the_days_usage(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    rclient.hset(keys.tenants, "acme", TenantConfig(requests_per_min=2).to_json())
    idle = TenantConfig(requests_per_min=1, over_quota="idle")
    rclient.hset(keys.tenants, "idler", idle.to_json())

    def admit(tenant: str, rid: str) -> str:
        args = [0, "", 60, 0, *once_keys(keys), keys.base_prefix, tenant, rid]
        return rclient.eval(_ADMIT, 0, *args).decode()

    before = rclient.time()[0]
    got = [admit("acme", f"acme.{i}") for i in range(5)]
    got += [admit("idler", f"idler.{i}") for i in range(3)]  # held over quota, not refused
    if before // 60 != rclient.time()[0] // 60:
        pytest.skip("a minute ended between the admissions")  # counts start again
    assert got[:5] == ["", "", "requests_per_min", "requests_per_min", "requests_per_min"]
    day = keys.usage(usage_day(before))
    assert rclient.hgetall(day) == {b"acme|refused": b"3"}
    assert 0 < rclient.ttl(day) <= USAGE_TTL_DAYS * 86400
