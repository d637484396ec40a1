"""Tenants on the wire (docs/protocol.md, Tenants), tried under Redis's own ACLs: tenant A's
Redis user (``batchline acl --tenant``'s rules) cannot enqueue as B (its elements are admitted
as A's, or refused), read B's results or replies, nor cancel B's requests; a ``tn`` forged in
the shared inbox is removed; tenants never share cached answers; a tenant producer's round
trip, and one producer serving several tenants (the web backend's way). Real Redis 7, the
doc's producer and worker users, workers in this process."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import redis

from batchline.acl import acl_rules, tenant_rules, tenant_setuser
from batchline.codec import pack_value
from batchline.config import ProducerSettings, WorkerSettings
from batchline.errors import QuotaExceeded, RequestCancelled, TenantNotAllowed
from batchline.keys import QueueKeys, TenantKeys
from batchline.producer import AsyncProducer, Producer
from batchline.producer._tenancy import estimate_cost, producer_id_for, request_id_for
from batchline.tenants import TenantConfig
from batchline.transport import (
    CANCEL_TENANT,
    ENQUEUE_TENANT,
    TenantMirror,
    as_client,
    cache_hash,
    input_hash,
    once_keys,
    usage_day,
)
from batchline.transport._functions import ENQUEUE
from batchline.transport._lua import TENANTS
from batchline.worker.serving._admitter import FIRST_CALL, PER_CALL, Admitter

from tests.support.models_for_tests import GatedModel
from tests.support.protocol_doc import doc_block
from tests.support.quota import Configure
from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerThread,
    admit_inbox,
    run_cli,
    wait_until,
)

T = RESULT_TIMEOUT_S
MODEL_ID = "m1"


@pytest.fixture
def tenant_url(
    acl_user: Callable[[list[str]], str], keys: QueueKeys, urls: dict[str, str]
) -> Callable[[str], str]:
    """A URL logged in as a tenant's producer user, made from ``tenant_rules`` (``urls``
    first: it skips the test below Redis 7)."""
    del urls
    return lambda tenant: acl_user(["on", ">PASSWORD", *tenant_rules(keys, tenant)])


def element(request_id: str, value: str, *, reply: str = "", prio: int = 1, **more: str) -> bytes:
    """A request as an inbox holds it, written by hand (as a forger would RPUSH it)."""
    fields = ["v", "2", "id", request_id, "meta", json.dumps(value)]
    if reply:
        fields += ["reply", reply]
    for name, text in more.items():
        fields += [name, text]
    return msgpack.packb(["r", prio, *fields], use_bin_type=False)


def enqueue_args(keys: QueueKeys, tenant: str, *requests: bytes) -> list[Any]:
    """How many KEYS, the KEYS and the ARGV of the tenant enqueue function for requests
    packed as ``element`` packs them."""
    flat: list[Any] = []
    for packed in requests:
        _r, prio, *fields = msgpack.unpackb(packed, raw=False)
        flat += [prio, len(fields), *fields]
    payload = msgpack.packb(flat, use_bin_type=False)
    tkeys = [keys.tenant_inbox(tenant), keys.wakes, keys.inbox, keys.admitting]
    args = [tenant, 100000, payload, 120, 0, *once_keys(keys), 0, keys.base_prefix]
    declared = [*tkeys, *keys.streams_low_first]
    return [len(declared), *declared, *args]


def admit(client: redis.Redis, keys: QueueKeys) -> None:
    """Admit the inbox and the wake list as a worker would (no worker running), one of many
    workers: the admission dispatches what it holds up to a batch (32) into the streams."""
    admit_inbox(client, keys, ahead=32)


def entries(client: redis.Redis, keys: QueueKeys) -> dict[str, dict[bytes, bytes]]:
    """The work streams' entries by request id."""
    found = {}
    for stream in keys.streams_low_first:
        for _entry, fields in client.xrange(stream):
            found[fields[b"id"].decode()] = fields
    return found


def dead_reasons(client: redis.Redis, keys: QueueKeys) -> list[tuple[str, str]]:
    return [
        (f[b"reason"].decode(), f.get(b"tenant", b"").decode())
        for _e, f in client.xrange(keys.dead)
    ]


# -- the admission's rules, no worker running ----------------------------------------------------


def test_a_tenants_requests_are_stamped_and_a_forged_tn_removed(
    urls: dict[str, str], tenant_url: Callable[[str], str], rclient: redis.Redis, keys: QueueKeys
) -> None:
    acme = redis.Redis.from_url(tenant_url("acme"))
    producer = redis.Redis.from_url(urls["producer"])
    try:
        wanted = element("acme.1", "a", reply="acme.p", tn="beta", cost="7")
        assert acme.fcall(ENQUEUE_TENANT, *enqueue_args(keys, "acme", wanted)) == [b"queued"]
        # The shared inbox, written by the producer user: an untenanted request naming a tn.
        producer.rpush(keys.inbox, element("plain.1", "b", tn="acme"))
    finally:
        acme.close()
        producer.close()
    admit(rclient, keys)
    found = entries(rclient, keys)
    assert found["acme.1"][b"tn"] == b"acme"
    assert found["acme.1"][b"cost"] == b"7"
    assert b"tn" not in found["plain.1"]
    assert rclient.xlen(keys.dead) == 0


def test_a_tenant_user_cannot_enqueue_as_another_tenant(
    tenant_url: Callable[[str], str], rclient: redis.Redis, keys: QueueKeys
) -> None:
    acme = redis.Redis.from_url(tenant_url("acme"))
    try:
        as_beta = element("beta.1", "x", reply="beta.p")
        refused = [
            lambda: acme.fcall(ENQUEUE_TENANT, *enqueue_args(keys, "beta", as_beta)),
            lambda: acme.rpush(keys.tenant_inbox("beta"), as_beta),
            lambda: acme.rpush(keys.inbox, as_beta),  # untenanted: no quota, no tenant
            lambda: acme.rpush(keys.job_list, msgpack.packb(["j", "beta.1", "embedding"])),
        ]
        for attempt in refused:
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        # The untenanted enqueue function: its RPUSH to the shared inbox is refused inside.
        streams = keys.streams_low_first
        payload = msgpack.packb([1, 4, "id", "acme.2", "meta", '"x"'], use_bin_type=False)
        args = [0, payload, 120, 0, *once_keys(keys), 0]
        with pytest.raises(redis.exceptions.ResponseError, match="can't access"):
            acme.fcall(ENQUEUE, 5, keys.inbox, keys.admitting, *streams, *args)
        # Through its own function, another tenant's id or reply is refused at once.
        for forged in (as_beta, element("acme.2", "x", reply="beta.p")):
            answer = acme.fcall(ENQUEUE_TENANT, *enqueue_args(keys, "acme", forged))
            assert answer[0][0] == b"invalid", answer
        # Appended to its own inbox by hand: admitted as acme's, or refused; nothing is
        # pushed to beta's reply stream.
        acme.rpush(
            keys.tenant_inbox("acme"),
            element("beta.3", "x", reply="beta.p"),
            element("acme.4", "x", reply="beta.p"),
            element("acme.5", "x", tn="beta"),
        )
        acme.rpush(keys.wakes, msgpack.packb(["t", "acme"]))
    finally:
        acme.close()
    assert rclient.llen(keys.inbox) == 0
    admit(rclient, keys)
    found = entries(rclient, keys)
    assert set(found) == {"acme.5"}
    assert found["acme.5"][b"tn"] == b"acme"
    assert (
        dead_reasons(rclient, keys)
        == [
            (
                "MalformedRequest: inbox element refused: its id and reply must start with acme.",
                "acme",
            )
        ]
        * 2
    )
    assert not rclient.exists(keys.reply("beta.p"))


def test_a_tenant_user_reads_and_cancels_only_its_own(
    urls: dict[str, str], tenant_url: Callable[[str], str], rclient: redis.Redis, keys: QueueKeys
) -> None:
    for name in ("beta.1", "acme.1"):
        rclient.set(keys.result(name), b"x")
        rclient.xadd(keys.reply(name[:5] + "p"), {"n": "1"})
    acme = redis.Redis.from_url(tenant_url("acme"))
    try:
        assert acme.get(keys.result("acme.1")) == b"x"
        assert acme.xread({keys.reply("acme.p"): "0-0"})
        for refused in (
            lambda: acme.get(keys.result("beta.1")),
            lambda: acme.get(keys.request_input("beta.1")),
            lambda: acme.get(keys.job("beta.1")),
            lambda: acme.xread({keys.reply("beta.p"): "0-0"}),
            lambda: acme.delete(keys.reply("beta.p")),
            lambda: acme.fcall(
                CANCEL_TENANT, 2, keys.tenant_inbox("beta"), keys.wakes, "beta", "beta.1"
            ),
            lambda: acme.rpush(keys.inbox, msgpack.packb(["c", "beta.1"])),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
        # Its own cancel function takes its own ids only; a cancel appended by hand to its
        # inbox under another's id is dead-lettered.
        inbox = keys.tenant_inbox("acme")
        assert acme.fcall(CANCEL_TENANT, 2, inbox, keys.wakes, "acme", "beta.1", "acme.1") == 1
        acme.rpush(inbox, msgpack.packb(["c", "beta.2"]))
        acme.rpush(keys.wakes, msgpack.packb(["t", "acme"]))
    finally:
        acme.close()
    admit(rclient, keys)
    cancelled = [f[b"id"] for _e, f in rclient.xrange(keys.cancels)]
    assert cancelled == [b"acme.1"]
    assert dead_reasons(rclient, keys) == [
        ("MalformedRequest: inbox element refused: an id of another tenant than acme", "acme")
    ]


def test_a_priority_above_the_tenants_max_is_lowered(
    tenant_url: Callable[[str], str], rclient: redis.Redis, keys: QueueKeys
) -> None:
    rclient.hset(keys.tenants, "acme", TenantConfig(max_priority=0).to_json())
    acme = redis.Redis.from_url(tenant_url("acme"))
    try:
        high = msgpack.packb(["r", 2, "v", "2", "id", "acme.1", "meta", '"x"', "prio", "2"])
        acme.fcall(ENQUEUE_TENANT, *enqueue_args(keys, "acme", high))
    finally:
        acme.close()
    admit(rclient, keys)
    [(_entry, fields)] = rclient.xrange(keys.stream(0))
    assert (fields[b"id"], fields[b"prio"]) == (b"acme.1", b"0")


def test_wakes_of_no_tenant_are_dead_lettered_and_a_long_inbox_is_woken_again(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    rclient.rpush(keys.tenant_inbox("acme"), *[element(f"acme.{i}", "x") for i in range(600)])
    rclient.rpush(keys.wakes, msgpack.packb(["t", "acme"]), b"junk", msgpack.packb(["t", "a.b"]))
    admitter = Admitter(None, WorkerSettings(queue=keys.queue), worker_id="test")
    admitted, left, *_ = rclient.execute_command("FCALL", *admitter.call())
    # acme's share (the 512: the two other wakes are refused), its wake again at the list's
    # end.
    assert admitted == 512
    assert left == 1
    assert rclient.lrange(keys.wakes, 0, -1) == [msgpack.packb(["t", "acme"])]
    admit(rclient, keys)
    # Every one admitted: in the work streams, or held for the fair share until the workers
    # can take it (two batches ahead).
    held = sum(rclient.llen(keys.backlog("acme", p)) for p in range(keys.priorities))
    assert len(entries(rclient, keys)) + held == 600
    assert [r for r, _t in dead_reasons(rclient, keys)] == [
        "MalformedRequest: inbox element refused: on the wake list: not a wake"
    ] * 2


def test_the_tenants_a_call_wakes_are_admitted_side_by_side(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    """Tenants' inboxes take 512 elements a call, a first call after a wait too (it takes 16
    of the inbox): shared between the tenants, so that the fair share's first dispatch sees
    every woken tenant's requests, not only the first one's (its share would go to the other
    until the next call)."""
    for tenant in ("acme", "beta"):
        inbox = keys.tenant_inbox(tenant)
        rclient.rpush(inbox, *[element(f"{tenant}.{i}", "x") for i in range(400)])
    rclient.rpush(keys.wakes, *[msgpack.packb(["t", t]) for t in ("acme", "beta")])
    admitter = Admitter(None, WorkerSettings(queue=keys.queue), worker_id="test")
    admitted, *_ = rclient.execute_command("FCALL", *admitter.call(FIRST_CALL))
    assert admitted == PER_CALL
    assert rclient.llen(keys.tenant_inbox("acme")) == 400 - PER_CALL // 2
    assert rclient.llen(keys.tenant_inbox("beta")) == 400 - PER_CALL // 2
    # Many wakes of two tenants (a wake a producer's call): shared between the two tenants.
    rclient.delete(keys.wakes)
    rclient.rpush(keys.wakes, *[msgpack.packb(["t", t]) for t in ("acme", "beta") * 30])
    rclient.rpush(keys.tenant_inbox("acme"), *[element(f"acme.x{i}", "x") for i in range(400)])
    before = [rclient.llen(keys.tenant_inbox(t)) for t in ("acme", "beta")]  # 544 and 144
    admitted, *_ = rclient.execute_command("FCALL", *admitter.call(FIRST_CALL))
    assert admitted == PER_CALL  # 256 asked of each: beta's 144, then acme 368 in all
    assert rclient.llen(keys.tenant_inbox("beta")) == 0
    assert rclient.llen(keys.tenant_inbox("acme")) == before[0] - (PER_CALL - before[1])


def test_a_tenant_with_many_wakes_takes_one_share_not_one_a_wake(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    """A tenant whose producers made many calls (a wake each) ahead of another tenant's one
    wake still takes one share of a call: the other tenant's requests are admitted in the
    same call, and one wake of each tenant whose inbox holds more is left, at the end."""
    acme = [element(f"acme.{i}", "x") for i in range(1000)]
    rclient.rpush(keys.tenant_inbox("acme"), *acme)
    rclient.rpush(keys.tenant_inbox("beta"), *[element(f"beta.{i}", "x") for i in range(100)])
    wake = {t: msgpack.packb(["t", t]) for t in ("acme", "beta", "gamma")}
    rclient.rpush(keys.wakes, *[wake["acme"]] * 40, wake["beta"])
    admitter = Admitter(None, WorkerSettings(queue=keys.queue), worker_id="test")
    admitted, left, *_ = rclient.execute_command("FCALL", *admitter.call(FIRST_CALL))
    assert admitted == PER_CALL
    assert rclient.llen(keys.tenant_inbox("beta")) == 0  # its 100, within its share of 256
    assert rclient.llen(keys.tenant_inbox("acme")) == 1000 - (PER_CALL - 100)
    assert rclient.lrange(keys.wakes, 0, -1) == [wake["acme"]]
    assert left == 1


def test_more_tenants_than_a_calls_elements_keep_their_wakes_under_the_worker_rules(
    urls: dict[str, str], rclient: redis.Redis, keys: QueueKeys
) -> None:
    """More tenants woken than a call takes elements, admitted by the documented worker user
    (which may append to the wake list, not prepend): the tenants the call did not reach get
    their wakes again first, in their order, then those whose inbox holds more; the calls
    after it admit the rest, and no wake is left."""
    tenants = [f"t{i}" for i in range(PER_CALL + 3)]
    for tenant in tenants:
        rclient.rpush(keys.tenant_inbox(tenant), *[element(f"{tenant}.{i}", "x") for i in (1, 2)])
    rclient.rpush(keys.wakes, *[msgpack.packb(["t", t]) for t in tenants])
    admitter = Admitter(None, WorkerSettings(queue=keys.queue), worker_id="test")
    worker = redis.Redis.from_url(urls["worker"])
    try:
        admitted, *_ = worker.execute_command("FCALL", *admitter.call(FIRST_CALL))
        assert admitted == PER_CALL  # one each of the first 512
        assert rclient.lrange(keys.wakes, 0, -1) == [
            msgpack.packb(["t", t]) for t in [*tenants[PER_CALL:], *tenants[:PER_CALL]]
        ]
        for _ in range(3):
            worker.execute_command("FCALL", *admitter.call())
    finally:
        worker.close()
    assert rclient.llen(keys.wakes) == 0
    assert all(rclient.llen(keys.tenant_inbox(t)) == 0 for t in tenants)
    held = sum(rclient.llen(keys.backlog(t, p)) for t in tenants for p in range(keys.priorities))
    assert len(entries(rclient, keys)) + held == 2 * len(tenants)
    assert not rclient.xlen(keys.dead)


def test_without_the_fair_share_a_call_admits_the_tenants_by_their_producers_clocks(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    """Without the fair share the work streams serve tenants' requests in the order they
    were admitted: a call's shares go in by their ``ts`` (the producers' clocks), each
    tenant's in its order, first come first served across tenants; without a ``ts``, in
    the order of the tenants' first wakes."""
    sent = {"acme": [1, 3, 5, 7, 9], "beta": [2, 4, 6, 8, 10], "gamma": [6, 2]}
    for tenant, stamps in sent.items():
        inbox = keys.tenant_inbox(tenant)
        rclient.rpush(
            inbox, *[element(f"{tenant}.{i}", "x", ts=f"{ms}.000") for i, ms in enumerate(stamps)]
        )
    # A cancel (no ts) follows the element before it in its tenant's inbox.
    rclient.rpush(keys.tenant_inbox("acme"), msgpack.packb(["c", "acme.0"]))
    rclient.rpush(keys.wakes, *[msgpack.packb(["t", t]) for t in ("beta", "acme", "gamma")])
    settings = WorkerSettings(queue=keys.queue, fair_share=False)
    admitter = Admitter(None, settings, worker_id="test")
    admitted, *_ = rclient.execute_command("FCALL", *admitter.call(FIRST_CALL))
    assert admitted == 13
    ids = [fields[b"id"].decode() for _entry, fields in rclient.xrange(keys.stream(1))]
    # gamma's clock went back: its second request keeps its place after its first (at 6,
    # after beta's 6: beta woke first).
    acme_beta = [f"{t}.{i}" for i in range(5) for t in ("acme", "beta")]
    assert ids == [*acme_beta[:6], "gamma.0", "gamma.1", *acme_beta[6:]]
    assert rclient.xlen(keys.cancels) == 1
    # The cancel came after its request: the request is marked cancelled (had it gone first,
    # the request would have gone in after it, unmarked).
    assert rclient.get(keys.request_input("acme.0")).endswith(b" !")
    assert rclient.llen(keys.wakes) == 0
    # No ts: the tenants' shares in the order of their first wakes.
    rclient.delete(keys.stream(1))
    for tenant in ("acme", "beta"):
        rclient.rpush(
            keys.tenant_inbox(tenant), *[element(f"{tenant}.n{i}", "x") for i in range(2)]
        )
    rclient.rpush(keys.wakes, *[msgpack.packb(["t", t]) for t in ("beta", "acme")])
    rclient.execute_command("FCALL", *admitter.call(FIRST_CALL))
    ids = [fields[b"id"].decode() for _entry, fields in rclient.xrange(keys.stream(1))]
    assert ids == ["beta.n0", "beta.n1", "acme.n0", "acme.n1"]


def max_min_shares(holds: dict[str, int], budget: int) -> dict[str, int]:
    """A call's shares as the protocol gives them (``holds``: each woken tenant's elements,
    in the order of its first wake): whoever holds no more than an equal share of what is
    left takes it all; the others an equal share of the rest, the first of them one more
    until the call's elements are used."""
    shares, rest = {}, budget
    sharing = [t for t in holds if holds[t]]
    for tenant in sorted(sharing, key=lambda t: holds[t]):
        if holds[tenant] > rest // (len(sharing) - len(shares)):
            break
        shares[tenant] = holds[tenant]
        rest -= holds[tenant]
    others = [t for t in sharing if t not in shares]
    for i, tenant in enumerate(others):
        shares[tenant] = rest // len(others) + (1 if i < rest % len(others) else 0)
    return {t: shares.get(t, 0) for t in holds}


def test_max_min_shares_as_the_protocol_gives_them() -> None:
    assert max_min_shares({"a": 600, "b": 10, "c": 600}, 512) == {"a": 251, "b": 10, "c": 251}
    assert max_min_shares({"a": 150, "b": 0, "c": 150, "d": 300}, 512) == {
        "a": 150, "b": 0, "c": 150, "d": 212
    }  # fmt: skip
    assert max_min_shares({"a": 1, "b": 1, "c": 1}, 2) == {"a": 1, "b": 1, "c": 0}
    assert max_min_shares({"a": 9, "b": 9, "c": 9}, 10) == {"a": 4, "b": 3, "c": 3}


@pytest.mark.parametrize("seed", range(16))
def test_a_calls_tenants_share_is_max_min_fair_and_loses_nothing(
    rclient: redis.Redis, keys: QueueKeys, seed: int
) -> None:
    """Random tenants (up to 700), inboxes and wakes (duplicates, and wakes of empty
    inboxes): one call gives each woken tenant exactly its max-min fair share of 512
    elements (``max_min_shares``); each tenant's elements in their order; nothing lost; and
    exactly one wake left for each tenant whose inbox still holds elements."""
    rng = random.Random(seed)
    if seed < 2:  # the cases where a share rounded up, or a last tenant taking the rest, fail
        tenants = ["t0", "t1", "t2"] if seed == 0 else ["t0", "t1", "t2", "t3"]
        sizes = dict(zip(tenants, [600, 10, 600] if seed == 0 else [150, 0, 150, 300]))
    elif seed % 3:  # a few tenants, up to more elements than a call takes
        tenants = [f"t{i}" for i in range(rng.randint(1, 7))]
        sizes = {t: rng.choice([0, 1, 5, 40, 150, 300, 600]) for t in tenants}
    else:  # many: more than a call's share of one element each too
        tenants = [f"t{i}" for i in range(rng.randint(30, 700))]
        sizes = {t: rng.choice([0, 1, 2, 5, 20]) for t in tenants}
    for tenant, size in sizes.items():
        if size:
            ids = [element(f"{tenant}.{i}", "x") for i in range(size)]
            rclient.rpush(keys.tenant_inbox(tenant), *ids)
    if seed < 2:
        woken, wakes = list(tenants), list(tenants)
    else:
        woken = [t for t in tenants if sizes[t] or rng.random() < 0.5]
        wakes = woken + [rng.choice(woken) for _ in range(rng.randint(0, 40))] if woken else []
        rng.shuffle(wakes)
    if wakes:
        rclient.rpush(keys.wakes, *[msgpack.packb(["t", t]) for t in wakes])
    settings = WorkerSettings(queue=keys.queue, fair_share=False)
    admitter = Admitter(None, settings, worker_id="test")
    admitted, *_ = rclient.execute_command("FCALL", *admitter.call(rng.choice([FIRST_CALL, 512])))
    first_wakes = list(dict.fromkeys(wakes))  # each tenant once, in the order of its first
    shares = max_min_shares({t: sizes[t] for t in first_wakes}, PER_CALL)
    assert admitted == min(PER_CALL, sum(sizes[t] for t in woken)) == sum(shares.values())
    ids = [f[b"id"].decode() for _e, f in rclient.xrange(keys.stream(1))]
    taken = Counter(i.split(".")[0] for i in ids)
    assert {t: taken[t] for t in first_wakes} == shares
    for tenant in tenants:
        mine = [int(i.split(".")[1]) for i in ids if i.startswith(tenant + ".")]
        assert mine == list(range(len(mine))), tenant  # oldest first
        left = rclient.llen(keys.tenant_inbox(tenant))
        assert taken[tenant] + left == sizes[tenant], tenant  # nothing lost
    left_woken = sorted(t for t in woken if rclient.llen(keys.tenant_inbox(t)))
    after = sorted(msgpack.unpackb(w)[1] for w in rclient.lrange(keys.wakes, 0, -1))
    assert after == left_woken
    assert not rclient.xlen(keys.dead)


def test_a_calls_equal_shares_round_down_and_the_first_take_one_more(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    """Equal shares that do not divide the call's elements: the first tenants in wake order
    take one more; a call asked for more than 512 shares what it was asked for."""
    tenants = ("t0", "t1", "t2")
    for tenant in tenants:
        rclient.rpush(
            keys.tenant_inbox(tenant), *[element(f"{tenant}.{i}", "x") for i in range(600)]
        )
    settings = WorkerSettings(queue=keys.queue, fair_share=False)
    admitter = Admitter(None, settings, worker_id="test")
    for most, shares in ((FIRST_CALL, (171, 171, 170)), (1000, (334, 333, 333))):
        before = [rclient.llen(keys.tenant_inbox(t)) for t in tenants]
        rclient.rpush(keys.wakes, *[msgpack.packb(["t", t]) for t in tenants])
        admitted, *_ = rclient.execute_command("FCALL", *admitter.call(most))
        after = [rclient.llen(keys.tenant_inbox(t)) for t in tenants]
        assert tuple(b - a for b, a in zip(before, after, strict=True)) == shares
        assert admitted == sum(shares) == max(most, PER_CALL)


def test_the_luas_tenant_keys_are_those_of_queue_keys(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    script = TENANTS + (
        "begin_tenants(ARGV[1], {})\n"
        "return {TK.inbox('t'), TK.wakes(), TK.tenants(), TK.backlog('t', 2), TK.fair(2),"
        " TK.fair_clock(), TK.backlog_counts(), TK.quota('t', 'r', 7), TK.in_flight('t'),"
        " TK.usage('20260101'), TK.waiters('t.1')}"
    )
    got = [k.decode() for k in rclient.eval(script, 0, keys.base_prefix)]
    assert got == [
        keys.tenant_inbox("t"),
        keys.wakes,
        keys.tenants,
        keys.backlog("t", 2),
        keys.fair(2),
        keys.fair_clock,
        keys.backlog_counts,
        keys.quota("t", "r", 7),
        keys.tenant_in_flight("t"),
        keys.usage("20260101"),
        keys.waiters("t.1"),
    ]


async def test_workers_mirror_the_tenant_store_when_its_version_moves(
    urls: dict[str, str], rclient: redis.Redis, keys: QueueKeys
) -> None:
    store = TenantKeys(keys.prefix)
    rclient.hset(store.config, mapping={"acme": TenantConfig(weight=3).to_json(), "x.y": "{}"})
    rclient.hset(store.config, "bad", "not json")
    rclient.set(store.version, 1)
    mirror = TenantMirror(keys, every_s=0)
    worker = as_client(redis.asyncio.Redis.from_url(urls["worker"]))  # the worker's rights
    try:
        assert await mirror.step(worker)
        assert rclient.hgetall(keys.tenants) == {b"acme": TenantConfig(weight=3).to_json().encode()}
        assert not await mirror.step(worker)  # the version did not move: one GET
        rclient.hdel(store.config, "acme")
        rclient.hset(store.config, "beta", TenantConfig(requests_per_min=5).to_json())
        rclient.incr(store.version)
        assert await mirror.step(worker)
        assert set(rclient.hgetall(keys.tenants)) == {b"beta"}
        with pytest.raises(redis.exceptions.NoPermissionError):
            await worker.hgetall(store.api_keys)  # never the API keys
    finally:
        await worker.aclose()
        rclient.delete(store.config, store.version)


# -- the producer's side -------------------------------------------------------------------------


def test_a_tenants_ids_are_in_its_namespace() -> None:
    assert request_id_for("acme", None).startswith("acme.")
    assert request_id_for("acme", "acme.order-1") == "acme.order-1"
    with pytest.raises(ValueError, match="'order-1' is not in tenant 'acme'"):
        request_id_for("acme", "order-1")
    with pytest.raises(ValueError, match="'beta.1' is not in tenant 'acme'"):
        request_id_for("acme", "beta.1")
    long = producer_id_for("t" * 64)
    assert long.startswith("t" * 64 + ".")
    assert len(long) <= 128
    assert len(long.rsplit("-", 1)[1]) == 32
    with pytest.raises(ValueError, match="tenant"):
        ProducerSettings(tenant="acme", admission="scripts")
    with pytest.raises(ValueError, match="tenant"):
        ProducerSettings(tenant="a.b")


def test_the_producer_estimates_a_requests_cost() -> None:
    assert estimate_cost("a text") == 1
    assert estimate_cost(["a", "b", "c"]) == 3
    assert estimate_cost({"query": "q", "documents": ["a", "b"]}) == 2
    assert estimate_cost({"prompt": "x" * 400, "max_new_tokens": 50}) == 150
    chat = {"messages": [{"role": "user", "content": "x" * 40}]}
    assert estimate_cost(chat) == 10 + 128
    assert estimate_cost("x" * 40, generation=True) == 10 + 128
    assert estimate_cost({"prompt": "x", "max_new_tokens": 10**9}) == 1_000_000


async def test_a_tenant_needs_the_functions(redis_url: str, queue: str) -> None:
    """The enqueue script cannot stamp a tenant: a producer that may use it only refuses a
    tenant's request before sending anything."""
    async with AsyncProducer(redis_url=redis_url, queue=queue, admission="scripts") as producer:
        with pytest.raises(ValueError, match="admission='scripts'"):
            await producer.submit("x", tenant="acme")
        assert await producer.queue_depth() == 0


# -- real workers ----------------------------------------------------------------------------


@pytest.mark.slow
async def test_tenant_producers_round_trip_and_one_producer_serves_many_tenants(
    urls: dict[str, str],
    tenant_url: Callable[[str], str],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    queue: str,
) -> None:
    common = {"queue": queue, "result_ttl_s": 120}
    start_worker(redis_url=urls["worker"], batch_size=4, **common)
    async with (
        AsyncProducer(redis_url=tenant_url("acme"), tenant="acme", **common) as acme,
        AsyncProducer(redis_url=urls["producer"], **common) as backend,
    ):
        assert acme.producer_id.startswith("acme.")
        handle = await acme.submit(["one", "two"])
        assert handle.id.startswith("acme.")
        assert handle.tenant == "acme"
        assert (await acme.wait(handle, timeout_s=T)).output == ["one", "two"]
        assert await acme.infer("mine", request_id="acme.order-1", timeout_s=T) == "mine"
        polled = await acme.get_result("acme.order-1")
        assert polled is not None
        assert polled.output == "mine"
        # The web backend's way: one producer, a tenant per call (a reply stream each).
        outputs = [
            await backend.infer(f"for {t}", tenant=t, timeout_s=T) for t in ("beta", "gamma", None)
        ]
        assert outputs == ["for beta", "for gamma", "for None"]
        again = await backend.submit("beta again", tenant="beta")
        assert (await backend.wait(again, timeout_s=T)).output == "beta again"
    assert rclient.xlen(keys.dead) == 0


@pytest.mark.slow
async def test_one_producers_first_requests_of_new_tenants_at_once_are_all_answered(
    urls: dict[str, str],
    start_worker: Callable[..., WorkerThread],
    queue: str,
) -> None:
    """The web backend's way under load: the first requests of several new tenants arrive
    together, each starting the reply reader over to read its tenant's stream too; every
    one is answered (overlapping start-overs once left no reader at all)."""
    common = {"queue": queue, "result_ttl_s": 120}
    start_worker(redis_url=urls["worker"], batch_size=8, **common)
    async with AsyncProducer(redis_url=urls["producer"], **common) as backend:
        for round_ in range(8):
            tenants = [f"t{round_}", f"t{max(round_ - 1, 0)}", f"u{round_}", f"v{round_}"]
            outputs = await asyncio.wait_for(
                asyncio.gather(*(backend.infer(t, tenant=t, timeout_s=T) for t in tenants)),
                timeout=2 * T,
            )
            assert outputs == tenants


@pytest.mark.slow
async def test_a_producer_naming_a_tenant_its_user_may_not_act_as_gets_a_typed_error(
    tenant_url: Callable[[str], str],
    start_worker: Callable[..., WorkerThread],
    urls: dict[str, str],
    rclient: redis.Redis,
    keys: QueueKeys,
    queue: str,
) -> None:
    common = {"queue": queue, "result_ttl_s": 120}
    start_worker(redis_url=urls["worker"], **common)  # loads the functions
    async with AsyncProducer(redis_url=tenant_url("acme"), tenant="acme", **common) as acme:
        assert await acme.infer("mine", timeout_s=T) == "mine"
        for attempt in (
            acme.submit("as another", tenant="beta"),
            acme.cancel("beta.1", tenant="beta"),
        ):
            with pytest.raises(TenantNotAllowed, match="tenant 'beta'"):
                await attempt
    assert not rclient.exists(keys.tenant_inbox("beta"))


@pytest.mark.slow
async def test_another_tenants_cancel_does_not_reach_a_request(
    urls: dict[str, str],
    tenant_url: Callable[[str], str],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    queue: str,
) -> None:
    model = GatedModel()
    common = {"queue": queue, "result_ttl_s": 120}
    start_worker(model, redis_url=urls["worker"], batch_size=1, **common)
    async with (
        AsyncProducer(redis_url=tenant_url("acme"), tenant="acme", **common) as acme,
        AsyncProducer(redis_url=tenant_url("beta"), tenant="beta", **common) as beta,
    ):
        first = await acme.submit("first")
        assert model.entered.wait(T), "no batch reached the model"
        victim = await acme.submit("the victim")
        mine = await acme.submit("cancelled by acme")
        thief = redis.Redis.from_url(tenant_url("beta"))
        try:
            thief.rpush(keys.tenant_inbox("beta"), msgpack.packb(["c", victim.id]))
            thief.rpush(keys.wakes, msgpack.packb(["t", "beta"]))
        finally:
            thief.close()
        with pytest.raises(ValueError, match="not in tenant 'beta'"):
            await beta.cancel(victim.id)
        await acme.cancel(mine)
        wait_until(lambda: rclient.xlen(keys.dead) == 1, "the forged cancel's dead letter")
        wait_until(lambda: rclient.xlen(keys.cancels) == 1, "acme's own cancel")
        model.release.set()
        assert (await acme.wait(first, timeout_s=T)).status == "ok"
        result = await acme.wait(victim, timeout_s=T)
        assert (result.status, result.output) == ("ok", "the victim")
        with pytest.raises(RequestCancelled):  # answered cancelled, once its turn came
            await acme.wait(mine, timeout_s=T)


@pytest.mark.slow
async def test_tenants_never_share_cached_answers(
    urls: dict[str, str],
    tenant_url: Callable[[str], str],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    queue: str,
) -> None:
    common = {"queue": queue, "result_ttl_s": 120, "cache_ttl_s": 60}
    start_worker(redis_url=urls["worker"], batch_size=1, model_id=MODEL_ID, **common)
    wait_until(lambda: rclient.exists(keys.model), "the worker's model identity")
    meta, blob = pack_value("the same input")
    h = input_hash(meta, blob)
    async with (
        AsyncProducer(redis_url=tenant_url("acme"), tenant="acme", **common) as acme,
        AsyncProducer(redis_url=tenant_url("beta"), tenant="beta", **common) as beta,
        AsyncProducer(redis_url=urls["producer"], **common) as plain,
    ):
        assert await acme.infer("the same input", timeout_s=T) == "the same input"
        assert rclient.exists(keys.cache(cache_hash(MODEL_ID, h, "acme")))
        assert await beta.infer("the same input", timeout_s=T) == "the same input"
        assert await plain.infer("the same input", timeout_s=T) == "the same input"
        assert beta.counts == Counter(queued=1)  # computed again, not acme's answer
        assert plain.counts == Counter(queued=1)
        assert await acme.infer("the same input", timeout_s=T) == "the same input"
        assert acme.counts == Counter(queued=1, cached=1)  # its own
    for owner in ("acme", "beta", None):
        assert rclient.exists(keys.cache(cache_hash(MODEL_ID, h, owner)))


# -- the quota hooks (batchline/transport/_quota.py; tests/transport/test_quota_lua.py) ------


def _count(rclient: redis.Redis, keys: QueueKeys, kind: str, n: int | None) -> None:
    """acme's count of ``kind`` in Redis's minute and the next (a minute may turn)."""
    s, us = rclient.time()
    minute = (s * 1000 + us // 1000) // 60000
    for m in (minute, minute + 1):
        if n is None:
            rclient.delete(keys.quota("acme", kind, m))
        else:
            rclient.set(keys.quota("acme", kind, m), n, ex=180)


async def test_the_quota_hooks_refuse_at_once_and_at_the_admission(
    redis_url: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    queue: str,
) -> None:
    config = TenantConfig(requests_per_min=1, tokens_per_min=10)
    rclient.hset(keys.tenants, "acme", config.to_json())
    _count(rclient, keys, "t", 10)
    async with AsyncProducer(redis_url=redis_url, queue=queue, tenant="acme") as acme:
        with pytest.raises(QuotaExceeded) as told:
            await acme.submit("x", cost=7)
        assert (told.value.tenant, told.value.limit) == ("acme", "tokens_per_min")
        assert 0 < told.value.retry_after_s <= 60
        _count(rclient, keys, "t", None)
        later = await acme.submit("y", request_id="acme.later-1")
    _count(rclient, keys, "r", 1)  # another replica's request, admitted meanwhile
    admitter = Admitter(None, WorkerSettings(queue=keys.queue), worker_id="test")
    admitted, _left, _full, _withheld, over, _held = rclient.execute_command(
        "FCALL", *admitter.call()
    )
    assert (admitted, over) == (1, 1)
    assert entries(rclient, keys) == {}
    stored = msgpack.unpackb(rclient.get(keys.result(later.id)), raw=False)
    fields = dict(zip(stored[::2], stored[1::2], strict=True))
    assert fields["etype"] == "QuotaExceeded"
    assert fields["emsg"].startswith("tenant acme: requests_per_min=1 reached; retry in ")
    assert 0 < int(fields["retry_ms"]) <= 60_000
    assert rclient.get(keys.request_input(later.id)).endswith(b" !")  # a resubmit runs again


async def test_a_request_refused_over_quota_leaves_no_in_flight_mark(
    redis_url: str, rclient: redis.Redis, keys: QueueKeys, queue: str
) -> None:
    """With the cache on, a new request marks its input in flight, so that requests of the
    same input wait for its answer: one refused over a quota never runs, so its input must
    not stay marked, or every later request of that input would wait for ever."""
    rclient.hset(keys.tenants, "acme", TenantConfig(requests_per_min=1).to_json())
    rclient.set(keys.model, MODEL_ID)
    settings = WorkerSettings(queue=keys.queue, cache_ttl_s=60, result_ttl_s=120)
    admitter = Admitter(None, settings, worker_id="test")
    common = {"result_ttl_s": 120, "cache_ttl_s": 60}
    async with AsyncProducer(redis_url=redis_url, queue=queue, tenant="acme", **common) as acme:
        first = await acme.submit("same", request_id="acme.first")
        _count(rclient, keys, "r", 1)  # another replica's request, admitted meanwhile
        _admitted, _left, _full, _withheld, over, _held = rclient.execute_command(
            "FCALL", *admitter.call()
        )
        assert over == 1
        assert (await acme.wait(first, timeout_s=T)).error_type == "QuotaExceeded"
        assert rclient.keys(keys.in_flight("*")) == []
        _count(rclient, keys, "r", None)  # the next minute: room again
        again = await acme.submit("same", request_id="acme.again")
        rclient.execute_command("FCALL", *admitter.call())
    assert set(entries(rclient, keys)) == {again.id}, "it runs (not coalesced onto the first)"


def test_batchline_acl_prints_a_tenants_user() -> None:
    done = run_cli("acl", "--tenant", "acme", "--queue", "q")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == tenant_setuser(QueueKeys("q"), "acme")
    assert "batchline-tenant-acme" in done.stdout
    bad = run_cli("acl", "--tenant", "a.b")
    assert bad.returncode != 0
    assert "'a.b'" in bad.stderr


def test_the_documented_tenant_user_is_what_batchline_acl_prints() -> None:
    block = doc_block("acl", "as `batchline acl --tenant\nacme` prints it")
    assert block.splitlines() == [tenant_setuser(QueueKeys("default"), "acme")]


def test_the_blocking_producer_takes_tenants_too(
    redis_url: str, queue: str, rclient: redis.Redis, keys: QueueKeys
) -> None:
    """No worker: what a tenant's producer writes waits in the tenant's inbox, with a wake."""
    with Producer(redis_url=redis_url, queue=queue, tenant="acme") as acme:
        assert acme.tenant == "acme"
        handle = acme.submit("x", reply=False)
        assert handle.id.startswith("acme.")
        other = acme.submit(["a", "b"], tenant="beta", reply=False)
        assert other.tenant == "beta"
        assert acme.queue_depth() == 1  # its own inbox counted, not beta's
        assert rclient.llen(keys.tenant_inbox("beta")) == 1
        assert acme.get_result(handle.id) is None
        with pytest.raises(ValueError, match="not in tenant 'acme'"):
            acme.get_result(other.id)
        acme.cancel(handle)
        acme.cancel(other)  # the handle's tenant
        with pytest.raises(ValueError, match="not in tenant 'acme'"):
            acme.cancel(other.id)
    assert rclient.llen(keys.tenant_inbox("acme")) == 2  # the request, its cancel
    assert rclient.llen(keys.wakes) == 4
    [packed] = rclient.lrange(keys.tenant_inbox("beta"), 0, 0)
    fields = msgpack.unpackb(packed, raw=False)[2:]
    named = dict(zip(fields[::2], fields[1::2], strict=True))
    assert named["cost"] == "2"  # two texts
    assert "tn" not in named  # the admission's to write


def test_a_worker_under_rules_from_before_tenants_admits_the_inbox_still(
    acl_user: Callable[[list[str]], str],
    urls: dict[str, str],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    """Workers upgraded before their ACL: untenanted requests are admitted as before."""
    tenants = (":in:*", ":wake", ":tenants", ":bl:", ":fair", ":backlog", ":quota:", ":inflight:")
    old = [
        r
        for r in acl_rules(keys, "worker")
        if not any(k in r for k in (*tenants, ":usage:", "{tenants}"))
    ]
    worker = redis.Redis.from_url(acl_user(["on", ">PASSWORD", *old]))
    rclient.rpush(keys.inbox, element("plain.1", "x"))
    rclient.rpush(keys.wakes, msgpack.packb(["t", "acme"]))
    admitter = Admitter(None, WorkerSettings(queue=keys.queue), worker_id="test")
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.llen(keys.wakes)
        admitted, left, *_ = worker.execute_command("FCALL", *admitter.call())
    finally:
        worker.close()
    assert (admitted, left) == (1, 0)
    assert set(entries(rclient, keys)) == {"plain.1"}
    assert rclient.llen(keys.wakes) == 1  # for a worker that may


@pytest.mark.slow
async def test_a_tenants_coalesced_requests_run_again_as_the_tenants(
    redis_url: str,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    queue: str,
) -> None:
    """A leader cancelled: the request coalesced onto it runs as an entry of its own, with
    the leader's tn, so that its answer fills the tenant's cache."""
    common = {"queue": queue, "result_ttl_s": 120, "cache_ttl_s": 60}
    model = GatedModel()
    worker = start_worker(model, batch_size=1, timeout_ms=600_000.0, model_id=MODEL_ID, **common)
    wait_until(lambda: rclient.exists(keys.model), "the worker's model identity")
    async with (
        AsyncProducer(redis_url=redis_url, tenant="acme", **common) as a,
        AsyncProducer(redis_url=redis_url, tenant="acme", **common) as b,
    ):
        blocker = await a.submit("blocker")
        assert model.entered.wait(T), "no batch reached the model"
        leader = await a.submit("same text")
        joined = await b.submit("same text")
        wait_until(lambda: b.counts["coalesced"] == 1, "the coalesced request")
        wait_until(lambda: rclient.xlen(keys.stream(1)) == 2, "both admitted")
        await a.cancel(leader)
        wait_until(lambda: leader.id in worker.worker._parts.cancels, "the cancel's arrival")
        model.release.set()
        assert await a.result(blocker, timeout_s=T) == "blocker"
        assert (await b.wait(joined, timeout_s=T)).output == "same text"
    meta, blob = pack_value("same text")
    assert rclient.exists(keys.cache(cache_hash(MODEL_ID, input_hash(meta, blob), "acme")))


@pytest.mark.slow
async def test_quotas_are_counted_and_refused_under_the_documented_users(
    configure: Configure,
    urls: dict[str, str],
    tenant_url: Callable[[str], str],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    queue: str,
) -> None:
    """A tenant's user (its look at the counts: HGET, GET, ZCOUNT, TIME), the web backend's
    (the same for any tenant) and the worker's (the admission's counts, the completion's
    release and usage) have the rights the quotas need."""
    common = {"queue": queue, "result_ttl_s": 120}
    start_worker(redis_url=urls["worker"], **common)
    configure("acme", TenantConfig(requests_per_min=2), wait=True)
    async with (
        AsyncProducer(redis_url=tenant_url("acme"), tenant="acme", **common) as acme,
        AsyncProducer(redis_url=urls["producer"], **common) as backend,
    ):
        assert await acme.infer("one", timeout_s=T) == "one"
        assert await backend.infer("two", tenant="acme", timeout_s=T) == "two"
        for refused in (acme.submit("three"), backend.submit("three", tenant="acme")):
            with pytest.raises(QuotaExceeded):
                await refused
    assert rclient.zcard(keys.tenant_in_flight("acme")) == 0
    assert rclient.hget(keys.usage(usage_day(time.time())), "acme|requests") == b"2"


async def test_a_tenant_user_counts_the_requests_held_for_the_fair_share(
    tenant_url: Callable[[str], str], rclient: redis.Redis, keys: QueueKeys
) -> None:
    """The depth a tenant's producer sees (``queue_depth()``, its ``max_depth``) counts the
    requests held in the backlogs, as the producer user's does: the tenant user may read
    their counts (no tenant's name), and its enqueue is refused no read."""
    url = tenant_url("acme")
    rclient.hset(keys.backlog_counts, mapping={"beta": 3, "-": 2})  # as the admission keeps it
    async with AsyncProducer(redis_url=url, queue=keys.queue, tenant="acme") as producer:
        assert await producer.queue_depth() == 5
    acme = redis.Redis.from_url(url)
    try:
        call = enqueue_args(keys, "acme", element("acme.1", "a", reply="acme.p"))
        at = call.index(100000)
        call[at] = 5  # max_depth: the held requests fill the queue
        assert acme.fcall(ENQUEUE_TENANT, *call) == [None]
        user = url.split("//")[1].split(":", maxsplit=1)[0]
        assert not [e for e in rclient.acl_log() if e.get("username") == user]
    finally:
        acme.close()
