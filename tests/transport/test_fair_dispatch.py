"""The fair share's dispatch in Redis (batchline/transport/_fair.py), through the queue's admit
and dispatch functions on a real Redis 7, without workers: what reaches the work stream, in
which order, against a model of start-time fair queueing written here from docs/protocol.md
(Tenants: the fair share). A request admitted while nothing is backlogged at its priority and
its stream has room goes to the stream in the same call, never through a backlog list; a
lone backlogged tenant is dispatched a run at a time; neither changes the order."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest
import redis

from batchline.keys import GROUP, QueueKeys
from batchline.tenants import TenantConfig
from batchline.transport import DISPATCH, fair_args

from tests.support.service import admit_inbox
from tests.support.tenant_inbox import cancel, enqueue, enqueue_each

TTL_S = 3600


def stream_ids(client: redis.Redis, keys: QueueKeys, priority: int = 0) -> list[str]:
    """The request ids of a work stream's entries, oldest first."""
    return [f[b"id"].decode() for _e, f in client.xrange(keys.stream(priority))]


def take(client: redis.Redis, keys: QueueKeys, priority: int = 0) -> list[str]:
    """What a work stream holds, deleted (so that the dispatch sees room again)."""
    entries = client.xrange(keys.stream(priority))
    if entries:
        client.xdel(keys.stream(priority), *[e for e, _f in entries])
    return [f[b"id"].decode() for _e, f in entries]


def dispatch(client: redis.Redis, keys: QueueKeys, ahead: int, *corrections: Any) -> int:
    """One call of the dispatch function, as a worker that fills each stream to ``ahead``."""
    streams = keys.streams_low_first
    args = fair_args(keys, ahead=ahead, on=True, result_ttl_s=TTL_S)
    held = client.execute_command(
        "FCALL", DISPATCH, len(streams), *streams, keys.base_prefix, *args, *corrections
    )
    return int(held)


def admit(client: redis.Redis, keys: QueueKeys, batch_size: int) -> None:
    """Admit the inboxes as the admission would with room for 2 batches of ``batch_size`` in
    the stream (one of many workers, each reading as it comes)."""
    admit_inbox(client, keys, ahead=2 * batch_size, batch_size=batch_size, result_ttl_s=TTL_S)


class Model:
    """Start-time fair queueing of one priority, as docs/protocol.md states it: held requests
    are dispatched least virtual start first (ties by name) while the stream has room."""

    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = weights
        self.backlog: dict[str, list[tuple[str, int]]] = {}
        self.start: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.clock = 0.0
        self.stream: list[str] = []

    def hold(self, tenant: str, request_id: str, cost: int) -> None:
        queue = self.backlog.setdefault(tenant, [])
        if not queue:
            self.start[tenant] = max(self.clock, self.last.get(tenant, 0.0))
        queue.append((request_id, cost))

    def fill(self, ahead: int) -> None:
        while len(self.stream) < ahead:
            busy = [t for t, q in self.backlog.items() if q]
            if not busy:
                return
            tenant = min(busy, key=lambda t: (self.start[t], t))
            request_id, cost = self.backlog[tenant].pop(0)
            start = self.start[tenant]
            self.clock = max(self.clock, start)
            finish = start + cost / self.weights.get(tenant, 1.0)
            self.start[tenant] = finish
            if not self.backlog[tenant]:
                self.last[tenant] = finish
            self.stream.append(request_id)

    def take(self) -> list[str]:
        taken, self.stream = self.stream, []
        return taken


def test_requests_with_nothing_backlogged_go_straight_in_the_fair_order(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    a = enqueue_each(rclient, keys, "A", 3)
    b = enqueue_each(rclient, keys, "B", 2)
    admit(rclient, keys, batch_size=4)  # room for 8
    # One call admitted all five: none backlogged before it, they went in the fair order
    # (A first on a tie of virtual starts: its name comes first).
    assert stream_ids(rclient, keys) == [a[0], b[0], a[1], b[1], a[2]]
    assert not rclient.exists(keys.backlog("A", 0), keys.backlog("B", 0), keys.fair(0))
    assert int(rclient.hget(keys.backlog_counts, "0") or 0) == 0
    # Their virtual times moved as if they had been held and dispatched at once.
    clock = rclient.hgetall(keys.fair_clock)
    assert float(clock[b"0"]) == 2
    assert float(clock[b"last:A:0"]) == 3
    assert float(clock[b"last:B:0"]) == 2
    # Each rid: names its entry, as any queued request's does.
    entries = [e.decode() for e, _f in rclient.xrange(keys.stream(0))]
    for request_id, entry in zip([a[0], b[0], a[1], b[1], a[2]], entries, strict=True):
        assert rclient.get(keys.request_input(request_id)).decode().endswith(" @" + entry)
    # The in-flight set of a tenant still counts them and expires.
    assert rclient.zcard(keys.tenant_in_flight("A")) == 3
    assert 0 < rclient.ttl(keys.tenant_in_flight("A")) <= TTL_S


def test_the_fair_order_holds_once_a_backlog_forms(rclient: redis.Redis, keys: QueueKeys) -> None:
    a = enqueue_each(rclient, keys, "A", 10)
    admit(rclient, keys, batch_size=1)  # room for 2: A0, A1 go, 8 held
    assert stream_ids(rclient, keys) == a[:2]
    assert rclient.llen(keys.backlog("A", 0)) == 8
    assert rclient.hget(keys.backlog_counts, "0") == b"8"
    b = enqueue_each(rclient, keys, "B", 2)
    admit(rclient, keys, batch_size=1)  # A backlogged: B is held too
    assert rclient.llen(keys.backlog("B", 0)) == 2
    order = take(rclient, keys)
    while dispatch(rclient, keys, 2) or rclient.xlen(keys.stream(0)):
        order += take(rclient, keys)
    # B became backlogged at the clock (A1's start), A's next start is A1's finish.
    assert order == [a[0], a[1], b[0], a[2], b[1], *a[3:]]
    assert rclient.hvals(keys.backlog_counts) == [b"0"]
    assert not rclient.exists(keys.backlog("A", 0), keys.backlog("B", 0), keys.fair(0))


def test_a_lone_backlogged_tenant_is_dispatched_a_run_at_a_time(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    rclient.hset(keys.tenants, "A", TenantConfig(weight=2).to_json())
    a = enqueue_each(rclient, keys, "A", 20, cost=3)
    admit(rclient, keys, batch_size=1)
    take(rclient, keys)
    assert dispatch(rclient, keys, 10) == 8  # ten in one run, eight still held
    assert take(rclient, keys) == a[2:12]
    assert float(rclient.zscore(keys.fair(0), "A")) == 12 * 3 / 2
    assert dispatch(rclient, keys, 10) == 0
    assert take(rclient, keys) == a[12:]
    clock = rclient.hgetall(keys.fair_clock)
    assert float(clock[b"last:A:0"]) == 20 * 3 / 2
    assert float(clock[b"0"]) == 19 * 3 / 2
    assert not rclient.exists(keys.fair(0), keys.backlog("A", 0))


@pytest.mark.parametrize("seed", range(6))
def test_dispatch_order_is_start_time_fair_queueing(
    rclient: redis.Redis, keys: QueueKeys, seed: int
) -> None:
    """Random arrivals, costs and ``ahead``s across admit and dispatch calls: the stream gets
    exactly what the model dispatches, when it does."""
    rng = random.Random(seed)
    weights = {"A": 3.0, "B": 1.0, "C": 2.0}
    for tenant, weight in weights.items():
        rclient.hset(keys.tenants, tenant, TenantConfig(weight=weight).to_json())
    model, got, expected, n = Model(weights), [], [], 0
    for _round in range(12):
        for _ in range(rng.randint(0, 12)):
            tenant, cost = rng.choice("ABC"), rng.randint(1, 5)
            model.hold(tenant, enqueue(rclient, keys, tenant, f"r{n}", n, cost=cost), cost)
            n += 1
        batch = rng.randint(1, 3)
        admit(rclient, keys, batch_size=batch)
        model.fill(2 * batch)
        assert stream_ids(rclient, keys) == model.stream
        for _ in range(rng.randint(0, 3)):
            got, expected = got + take(rclient, keys), expected + model.take()
            ahead = rng.randint(1, 6)
            dispatch(rclient, keys, ahead)
            model.fill(ahead)
            assert stream_ids(rclient, keys) == model.stream
    while True:
        got, expected = got + take(rclient, keys), expected + model.take()
        held = dispatch(rclient, keys, 4)
        model.fill(4)
        assert stream_ids(rclient, keys) == model.stream
        if not held and not model.stream:
            break
    assert got == expected
    assert len(got) == n


def test_a_request_cancelled_in_the_call_that_held_it_goes_stamped(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    a = enqueue_each(rclient, keys, "A", 2)
    cancel(rclient, keys, "A", a[1])
    admit(rclient, keys, batch_size=2)
    fields = [f for _e, f in rclient.xrange(keys.stream(0))]
    assert [f[b"id"].decode() for f in fields] == a
    assert fields[0][b"ts"] != b"1"
    assert fields[1][b"ts"] == b"1"
    assert rclient.get(keys.request_input(a[1])).decode().endswith(" !")


def test_a_request_leaving_a_backlog_names_its_entry_unless_cancelled_or_expired(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    rclient.xgroup_create(keys.stream(0), GROUP, id="0", mkstream=True)
    a = enqueue_each(rclient, keys, "A", 5)
    admit(rclient, keys, batch_size=1)  # room for 2: a0, a1 go, a2-a4 held in A's backlog
    assert rclient.llen(keys.backlog("A", 0)) == 3
    cancel(rclient, keys, "A", a[2])
    admit(rclient, keys, batch_size=1)  # the cancel, while a2 is held
    rclient.delete(keys.request_input(a[3]))  # a3's rid: expired while it was held
    take(rclient, keys)
    assert dispatch(rclient, keys, 8) == 0
    entries = rclient.xrange(keys.stream(0))
    # Each went once: no entry left behind by a copy that was not to go as it was.
    assert [f[b"id"].decode() for _e, f in entries] == a[2:]
    fields = {f[b"id"].decode(): (e.decode(), f) for e, f in entries}
    # Cancelled while held: stamped ts 1, its rid: still says cancelled, its TTL kept.
    assert fields[a[2]][1][b"ts"] == b"1"
    assert rclient.get(keys.request_input(a[2])).decode().endswith(" !")
    assert 0 < rclient.ttl(keys.request_input(a[2])) <= TTL_S
    # Expired: it goes, and no rid: is made for it (it would have no TTL).
    assert fields[a[3]][1][b"ts"] != b"1"
    assert not rclient.exists(keys.request_input(a[3]))
    # Waiting: its rid: names its entry, with the TTL it had.
    assert rclient.get(keys.request_input(a[4])).decode().endswith(" @" + fields[a[4]][0])
    assert 0 < rclient.ttl(keys.request_input(a[4])) <= TTL_S
    # No entry was added and deleted on the way: the group's lag stays known (autoscalers
    # and warm-first read it).
    assert rclient.xinfo_groups(keys.stream(0))[0]["lag"] is not None


def test_untenanted_requests_take_their_share_as_dash_once_a_tenant_is_backlogged(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    u = [enqueue(rclient, keys, None, f"u{i}", i) for i in range(2)]
    a = enqueue_each(rclient, keys, "A", 4)
    admit(rclient, keys, batch_size=1)
    # The shared inbox first: nothing backlogged, straight through; then A's four, held
    # (the stream full).
    assert stream_ids(rclient, keys) == u
    assert rclient.llen(keys.backlog("A", 0)) == 4
    u.append(enqueue(rclient, keys, None, "u2", 2))
    admit(rclient, keys, batch_size=1)
    assert rclient.llen(keys.backlog("-", 0)) == 1
    take(rclient, keys)
    dispatch(rclient, keys, 2)
    assert take(rclient, keys) == [u[2], a[0]]  # both start at 0: '-' sorts first


@pytest.mark.parametrize("batch_size", [1, 4], ids=["held", "straight"])
def test_an_id_sent_twice_in_one_call_is_one_request(
    rclient: redis.Redis, keys: QueueKeys, batch_size: int
) -> None:
    first = enqueue(rclient, keys, "A", "x", "X")
    enqueue(rclient, keys, "A", "y", "Y")
    assert enqueue(rclient, keys, "A", "x", "X") == first  # a resubmit in the same call
    admit(rclient, keys, batch_size=batch_size)
    while dispatch(rclient, keys, 8):
        pass
    assert stream_ids(rclient, keys) == [first, "A.y"]
    assert rclient.hget(keys.once_stats, "attached") == b"1"
    value = rclient.get(keys.request_input(first)).decode()
    assert value.endswith(" @" + rclient.xrange(keys.stream(0))[0][0].decode())
    assert rclient.ttl(keys.request_input(first)) > 0


def last_ts(client: redis.Redis, keys: QueueKeys, tenant: str) -> bytes:
    """The ``ts`` of the request last appended to ``tenant``'s inbox."""
    fields = msgpack.unpackb(client.lindex(keys.tenant_inbox(tenant), -1), raw=True)[2:]
    return dict(zip(fields[::2], fields[1::2], strict=True))[b"ts"]


def test_a_request_cancelled_and_sent_again_in_one_call_runs_once(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    first = enqueue(rclient, keys, "A", "x", "X")
    cancel(rclient, keys, "A", first)
    assert enqueue(rclient, keys, "A", "x", "X") == first  # sent again after its cancel
    sent = last_ts(rclient, keys, "A")
    admit(rclient, keys, batch_size=4)
    entries = rclient.xrange(keys.stream(0))
    # One entry, not cancelled (the second send wants it run): the second send's, its rid:
    # naming it.
    assert [f[b"id"].decode() for _e, f in entries] == [first]
    assert entries[0][1][b"ts"] == sent
    assert rclient.get(keys.request_input(first)).decode().endswith(" @" + entries[0][0].decode())
    assert 0 < rclient.ttl(keys.request_input(first)) <= TTL_S


@pytest.mark.parametrize("how", ["later calls", "one call", "a lower priority"])
def test_an_id_cancelled_while_held_and_sent_again_goes_as_sent_again(
    rclient: redis.Redis, keys: QueueKeys, how: str
) -> None:
    """The cancelled copy, held before it (in the same backlog, or at a priority dispatched
    first), is dropped: the one entry added is the later send's (its ts after the cancel,
    so that no worker's cancel log covers it)."""
    for p in (0, 1):  # each stream filled to its room (2): what follows is held
        for i in range(2):
            enqueue(rclient, keys, "F", f"f{p}{i}", f"F{p}{i}", priority=p)
    admit(rclient, keys, batch_size=1)
    first_prio = 1 if how == "a lower priority" else 0
    x = enqueue(rclient, keys, "A", "x", "X", priority=first_prio)
    if how != "one call":
        admit(rclient, keys, batch_size=1)
        assert rclient.get(keys.request_input(x))[40:] == b" @"
    cancel(rclient, keys, "A", x)
    if how != "one call":
        admit(rclient, keys, batch_size=1)
    enqueue(rclient, keys, "A", "x", "X", priority=0)
    sent = last_ts(rclient, keys, "A")
    admit(rclient, keys, batch_size=1)
    # Held again for an id marked '!': tagged, rid: naming that copy alone.
    assert rclient.get(keys.request_input(x))[40:] == b" @#1 @"
    assert sum(int(n) for n in rclient.hvals(keys.backlog_counts)) == 2
    take(rclient, keys, 0)
    take(rclient, keys, 1)
    while dispatch(rclient, keys, 8):
        pass
    went = [
        (e.decode(), f)
        for stream in keys.streams_low_first
        for e, f in rclient.xrange(stream)
        if f[b"id"] == x.encode()
    ]
    assert [f[b"ts"] for _e, f in went] == [sent]
    assert rclient.get(keys.request_input(x))[40:].decode() == " @" + went[0][0]
    assert 0 < rclient.ttl(keys.request_input(x)) <= TTL_S
    assert {int(n) for n in rclient.hvals(keys.backlog_counts)} == {0}


def test_the_caller_of_a_held_copy_dropped_for_a_later_one_waits_for_its_answer(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    """A held request cancelled (by anyone) and sent again by another producer: the first
    copy is dropped at dispatch, and its producer, who may still wait, joins the id's
    waiters, answered with the later copy's answer."""
    for i in range(2):  # the stream filled to its room (2): what follows is held
        enqueue(rclient, keys, "F", f"f{i}", f"F{i}")
    admit(rclient, keys, batch_size=1)
    x = enqueue(rclient, keys, "A", "x", "X", reply="A.pA")
    admit(rclient, keys, batch_size=1)
    cancel(rclient, keys, "A", x)
    admit(rclient, keys, batch_size=1)
    enqueue(rclient, keys, "A", "x", "X", reply="A.pB")
    admit(rclient, keys, batch_size=1)
    take(rclient, keys, 0)
    while dispatch(rclient, keys, 8):
        pass
    went = [f for _e, f in rclient.xrange(keys.stream(0)) if f[b"id"] == x.encode()]
    assert [f[b"reply"] for f in went] == [b"A.pB"]
    (waiter,) = rclient.smembers(keys.waiters(x))
    assert waiter.decode().split(" ")[:2] == [x, "A.pA"]


def test_a_bad_element_under_the_id_of_a_request_held_in_the_same_call_is_withheld(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    first = enqueue(rclient, keys, "A", "x", "X")
    bad = ["r", 0, "id", first, "reply", "A.producer", "v", "2"]  # no meta: malformed
    rclient.rpush(keys.tenant_inbox("A"), msgpack.packb(bad, use_bin_type=False))
    admit(rclient, keys, batch_size=4)
    # The request goes; the error is not pushed to the reply named under its id.
    assert stream_ids(rclient, keys) == [first]
    assert not rclient.exists(keys.reply("A.producer"))
    dead = [f for _e, f in rclient.xrange(keys.dead)]
    assert [f.get(b"withheld") for f in dead] == [b"1"]


def test_requests_in_flight_are_counted_within_one_admit_call(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    rclient.hset(keys.tenants, "A", TenantConfig(max_in_flight=2).to_json())
    a = enqueue_each(rclient, keys, "A", 4)
    b = enqueue_each(rclient, keys, "B", 3)  # no limit: counted in flight all the same
    admit(rclient, keys, batch_size=8)
    assert stream_ids(rclient, keys) == [a[0], b[0], a[1], b[1], b[2]]
    assert {m.decode() for m in rclient.zrange(keys.tenant_in_flight("A"), 0, -1)} == set(a[:2])
    assert {m.decode() for m in rclient.zrange(keys.tenant_in_flight("B"), 0, -1)} == set(b)
    assert 0 < rclient.ttl(keys.tenant_in_flight("B")) <= TTL_S
    for request_id in a[2:]:
        assert b"QuotaExceeded" in rclient.get(keys.result(request_id))
