"""``batchline status --by-tenant`` and ``batchline usage`` read the queue's tenant keys as
docs/protocol.md (Tenants) writes them: written here by hand into a real Redis, then read
through the command."""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from batchline.cli import main
from batchline.keys import QueueKeys
from batchline.tenants import TenantConfig
from batchline.transport.by_tenant import usage_day


def _run(capsys: pytest.CaptureFixture[str], redis_url: str, *args: str) -> tuple[int, str]:
    code = main([args[0], "--redis-url", redis_url, *args[1:]])
    out, err = capsys.readouterr()
    return code, out + err


def _by_tenant(
    capsys: pytest.CaptureFixture[str], redis_url: str, queue: str
) -> dict[str, dict[str, Any]]:
    code, out = _run(capsys, redis_url, "status", "--queue", queue, "--by-tenant", "--json")
    assert code == 0, out
    shown = json.loads(out)
    assert shown["queue"] == queue
    return {t["tenant"]: t for t in shown["tenants"]}


def _write_tenants(rclient: redis.Redis, keys: QueueKeys, now: float) -> None:
    """Two configured tenants, one with a backlog at two priorities (some over quota), in
    flight and this minute's counters; today's usage of a third tenant and of untenanted."""
    acme = TenantConfig(weight=3, requests_per_min=60, tokens_per_min=1000, max_in_flight=5)
    rclient.hset(keys.tenants, mapping={"acme": acme.to_json(), "bob": TenantConfig().to_json()})
    rclient.rpush(keys.backlog("acme", 1), b"r1", b"r2", b"r3")
    rclient.rpush(keys.backlog("acme~over", 1), b"r4", b"r5")
    rclient.rpush(keys.backlog("acme", 0), b"r6")
    rclient.zadd(keys.fair(1), {"acme": 1.0})
    rclient.zadd(keys.fair_idle(1), {"acme~over": 2.0})  # held over quota (idle mode)
    rclient.zadd(keys.fair(0), {"acme": 1.0})
    ms = int(now * 1000)
    rclient.zadd(keys.tenant_in_flight("acme"), {"acme.a": ms + 60_000, "acme.b": ms + 60_000})
    rclient.zadd(keys.tenant_in_flight("acme"), {"acme.lost": ms - 1})  # past its expiry
    for minute in (int(now // 60), int(now // 60) + 1):  # the read may fall in the next one
        rclient.set(keys.quota("acme", "r", minute), 7)
        rclient.set(keys.quota("acme", "t", minute), 120)
    rclient.hset(
        keys.usage(usage_day(now)),
        mapping={"acme|requests": 10, "acme|tokens": 500, "acme|refused": 2, "-|requests": 4},
    )
    rclient.hset(keys.usage(usage_day(now)), "carol|requests", 1)


def test_status_by_tenant_reads_backlogs_in_flight_quota_counters_and_config(
    rclient: redis.Redis,
    keys: QueueKeys,
    redis_url: str,
    queue: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _write_tenants(rclient, keys, time.time())
    got = _by_tenant(capsys, redis_url, queue)
    assert list(got) == ["-", "acme", "bob", "carol"]  # untenanted first, then by name
    acme = got["acme"]
    assert acme["backlog"] == {"1": 5, "0": 1}
    assert acme["over_quota"] == {"1": 2}
    assert acme["queued"] == 6
    assert acme["in_flight"] == 2
    assert (acme["requests_this_minute"], acme["tokens_this_minute"]) == (7, 120)
    assert (acme["requests_today"], acme["tokens_today"], acme["refused_today"]) == (10, 500, 2)
    assert (acme["weight"], acme["requests_per_min"], acme["max_in_flight"]) == (3, 60, 5)
    assert got["bob"]["configured"]
    assert got["bob"]["queued"] == 0
    assert not got["carol"]["configured"]
    assert got["carol"]["weight"] == 1
    assert got["-"]["requests_today"] == 4

    code, text = _run(capsys, redis_url, "status", "--queue", queue, "--by-tenant")
    assert code == 0, text
    (row,) = [line.split() for line in text.splitlines() if line.split()[:1] == ["acme"]]
    assert row[:6] == ["acme", "3", "p1:5", "(2", "over", "quota)"]
    assert "2/5" in row
    assert "7/60" in row
    assert "120/1000" in row


def test_status_by_tenant_of_a_queue_without_tenants_says_so(
    redis_url: str, queue: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _by_tenant(capsys, redis_url, queue) == {}
    code, text = _run(capsys, redis_url, "status", "--queue", queue, "--by-tenant")
    assert code == 0
    assert "no tenants" in text


def _usage(capsys: pytest.CaptureFixture[str], redis_url: str, *args: str) -> tuple[int, str]:
    return _run(capsys, redis_url, "usage", *args)


@pytest.fixture
def two_queues(rclient: redis.Redis, keys: QueueKeys, queue: str) -> Iterator[list[str]]:
    """Usage on two days of two queues (the same tenants on both)."""
    other = QueueKeys(f"{queue}-b", keys.prefix, keys.priorities)
    rclient.hset(
        keys.usage("20261101"),
        mapping={"acme|requests": 3, "acme|items": 30, "acme|tokens": 300, "bob|requests": 1},
    )
    rclient.hset(keys.usage("20261102"), mapping={"acme|requests": 2, "acme|items": 20})
    rclient.hset(other.usage("20261101"), mapping={"acme|requests": 5, "acme|tokens": 50})
    rclient.hset(other.usage("20261103"), mapping={"-|requests": 9, "-|items": 9})
    yield [queue, other.queue]
    rclient.delete(*(other.usage(d) for d in ("20261101", "20261103")))


def test_usage_sums_over_queues_per_tenant_and_day(
    two_queues: list[str], redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = two_queues
    code, out = _usage(
        capsys, redis_url, "--queue", a, "--queue", b, "--from", "20261101", "--to", "20261103"
    )
    assert code == 0, out
    code, out = _usage(
        capsys,
        redis_url,
        *("--queue", a, "--queue", b, "--from", "20261101", "--to", "20261103", "--json"),
    )
    assert code == 0, out
    shown = json.loads(out)
    rows = [(r["day"], r["tenant"], r["requests"], r["items"], r["tokens"]) for r in shown["days"]]
    assert rows == [
        ("20261101", "acme", 8, 30, 350),
        ("20261101", "bob", 1, 0, 0),
        ("20261102", "acme", 2, 20, 0),
        ("20261103", "-", 9, 9, 0),
    ]
    totals = {t["tenant"]: (t["requests"], t["items"], t["tokens"]) for t in shown["totals"]}
    assert totals == {"-": (9, 9, 0), "acme": (10, 50, 350), "bob": (1, 0, 0)}
    assert (shown["from"], shown["to"], shown["queues"]) == ("20261101", "20261103", [a, b])


def test_usage_of_one_day_one_tenant_as_csv_and_table(
    two_queues: list[str], redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    a, _b = two_queues
    code, out = _usage(capsys, redis_url, "--queue", a, "--day", "20261101", "--csv")
    assert code == 0, out
    assert list(csv.reader(io.StringIO(out))) == [
        ["day", "tenant", "requests", "items", "tokens", "refused"],
        ["20261101", "acme", "3", "30", "300", "0"],
        ["20261101", "bob", "1", "0", "0", "0"],
    ]
    code, out = _usage(capsys, redis_url, "--queue", a, "--day", "20261101", "--tenant", "bob")
    assert code == 0, out
    assert [line.split() for line in out.splitlines()[1:]] == [
        ["day", "tenant", "requests", "items", "tokens", "refused"],
        ["20261101", "bob", "1", "0", "0", "0"],
    ]
    code, out = _usage(capsys, redis_url, "--queue", a, "--day", "20200101")
    assert code == 0
    assert "no usage counted on 20200101" in out


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--day", "2026-11-01"], "a day is YYYYMMDD (UTC), got '2026-11-01'"),
        (["--from", "20261102", "--to", "20261101"], "ends (20261101) before it starts"),
        (["--day", "20261101", "--from", "20261101"], "--day or --from/--to"),
        (["--tenant", "a.b"], "got 'a.b'"),
        (["--json", "--csv"], "--json or --csv"),
    ],
)
def test_usage_refuses_a_bad_day_range_or_tenant_naming_it(
    args: list[str], said: str, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _usage(capsys, redis_url, *args)
    assert code == 2, out
    assert said in out, out
