"""Producer rights, tried as an attacker would: the producer and worker ACL users of
docs/protocol.md, created from the doc's own ``batchline acl`` lines. A producer-rights
client can neither write a work stream, the cancel stream, a result or a key of answers
computed once, nor run code of its own in Redis; what it may write (the inbox) is admitted
like a call of the enqueue function, so a forged request cannot run under another's id nor
overwrite its result, and nothing it does removes other producers' requests. The guards the
script's mode relies on (where producers write those keys: Redis 6.2, trusted producers)
are tried too, the forger there holding full rights. Real Redis, workers in this process (a
gated model whose batches the test sees), the producers of the package (which check a
result's input hash) and raw commands (as a producer in another language sends them)."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import pytest
import redis

from batchline.acl import ROLES, acl_setuser
from batchline.codec import pack_value
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer, Handle, Producer
from batchline.transport import cache_hash, input_hash

from tests.support.models_for_tests import GatedModel
from tests.support.protocol_doc import doc_block
from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, admitted, wait_until

T = RESULT_TIMEOUT_S
MODEL_ID = "m1"


def test_the_documented_rule_sets_are_what_batchline_acl_prints() -> None:
    block = doc_block("acl", "exactly as `batchline acl` prints them")
    keys = QueueKeys("default")
    assert block.splitlines() == [
        acl_setuser(keys, role, user=f"batchline-{role}") for role in ROLES
    ]


def hash_of(value: Any) -> str:
    meta, blob = pack_value(value)
    return input_hash(meta, blob)


@pytest.fixture
def serve(
    urls: dict[str, str],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    queue: str,
) -> Callable[..., dict[str, Any]]:
    """Start a worker under the worker user: ``serve(model, cache_ttl_s=...)`` returns the
    settings its producers share (queue, cache and result TTLs)."""

    def start(model: Any = "batchline.worker.models:echo", *, cache_ttl_s: int) -> dict[str, Any]:
        common = {"queue": queue, "cache_ttl_s": cache_ttl_s, "result_ttl_s": 120}
        start_worker(model, redis_url=urls["worker"], batch_size=1, model_id=MODEL_ID, **common)
        if cache_ttl_s:
            wait_until(lambda: rclient.exists(keys.model), "the worker's model identity")
        return common

    return start


@contextlib.asynccontextmanager
async def parties(
    url: str, common: dict[str, Any], *, thief_url: str | None = None
) -> AsyncIterator[tuple[redis.Redis, AsyncProducer, AsyncProducer]]:
    """With producer rights: a raw client (the forger's own commands; ``thief_url`` gives it
    other rights), the forger's producer and the victim's."""
    thief = redis.Redis.from_url(thief_url or url)
    try:
        async with (
            AsyncProducer(redis_url=url, **common) as attacker,
            AsyncProducer(redis_url=url, **common) as victim,
        ):
            yield thief, attacker, victim
    finally:
        thief.close()


async def running(attacker: AsyncProducer, model: GatedModel) -> Handle:
    """The attacker's request, held by the model (so what is added next waits behind it)."""
    evil = await attacker.submit("the attacker's input")
    assert model.entered.wait(T), "no batch reached the model"
    return evil


@pytest.mark.parametrize("cache_ttl_s", [0, 60], ids=["cache-off", "cache-on"])
@pytest.mark.slow
async def test_a_forged_waiter_gets_another_request_no_answer(
    redis_url: str,
    urls: dict[str, str],
    serve: Callable[..., dict[str, Any]],
    keys: QueueKeys,
    caplog: pytest.LogCaptureFixture,
    cache_ttl_s: int,
) -> None:
    model = GatedModel()
    common = serve(model, cache_ttl_s=cache_ttl_s)
    # The script's mode: producers who may write these keys (here, a user with all rights).
    async with parties(urls["producer"], common, thief_url=redis_url) as (thief, attacker, victim):
        evil = await running(attacker, model)
        mine = await victim.submit("the victim's input")  # queued behind it
        # The attacker names the victim's request (its id and reply stream) a waiter of its
        # own running request: as if coalesced, with its own input's hash, or none.
        claimed = hash_of("the attacker's input") if cache_ttl_s else ""
        thief.sadd(keys.waiters(evil.id), f"{mine.id} {victim.producer_id} {claimed}")
        model.release.set()
        assert (await attacker.wait(evil, timeout_s=T)).output == "the attacker's input"
        result = await victim.wait(mine, timeout_s=T)
        assert (result.id, result.status, result.output) == (mine.id, "ok", "the victim's input")
        stored = await victim.get_result(mine.id)
        assert stored is not None
        assert stored.output == "the victim's input"
        # Once answered, a result key is never replaced by a waiter's answer.
        model.release.clear()
        model.entered.clear()
        again = await attacker.submit("the attacker's second input")
        assert model.entered.wait(T), "no batch reached the model"
        claimed = hash_of("the attacker's second input") if cache_ttl_s else ""
        thief.sadd(keys.waiters(again.id), f"{mine.id} {victim.producer_id} {claimed}")
        model.release.set()
        assert (await attacker.wait(again, timeout_s=T)).status == "ok"
        stored = await victim.get_result(mine.id)
        assert stored is not None
        assert stored.output == "the victim's input"
    taken = [r.getMessage() for r in caplog.records if "another input" in r.getMessage()]
    # With the cache on, the forged answer was pushed (the script saw a matching hash) and
    # the victim's producer refused it by its input hash; with it off (no cache hash on the
    # entry), nothing was pushed.
    assert len(taken) == (1 if cache_ttl_s else 0), taken


def element(request_id: str, value: str, *, reply: str = "", prio: int = 1) -> bytes:
    """A request as the inbox holds it, written by hand (as a forger would RPUSH it)."""
    fields = ["v", "2", "id", request_id, "meta", json.dumps(value)]
    if reply:
        fields += ["reply", reply]
    return msgpack.packb(["r", prio, *fields], use_bin_type=False)


@pytest.mark.parametrize("when", ["answered", "pending"])
@pytest.mark.slow
async def test_a_forged_request_under_a_known_id_never_runs_nor_overwrites_its_result(
    urls: dict[str, str],
    serve: Callable[..., dict[str, Any]],
    rclient: redis.Redis,
    keys: QueueKeys,
    when: str,
) -> None:
    """A caller-chosen id (order-42): a request appended to the inbox under it with another
    input, after its answer or while it waits, is refused (RequestIdConflict to the forger,
    nothing queued): pollers and the victim's idempotent resubmit keep reading its own
    answer. Before, an entry XADDed under it replaced its result for good."""
    model = GatedModel()
    common = serve(model, cache_ttl_s=0)
    async with parties(urls["producer"], common) as (thief, attacker, victim):
        if when == "answered":
            model.release.set()
            mine = await victim.submit("the victim's input", request_id="order-42")
            assert (await victim.wait(mine, timeout_s=T)).output == "the victim's input"
        else:
            evil = await running(attacker, model)
            mine = await victim.submit("the victim's input", request_id="order-42")
        forged = element("order-42", "the forged input", reply=attacker.producer_id)
        thief.rpush(keys.inbox, forged)
        wait_until(lambda: thief.llen(keys.inbox) == 0, "the forged element's admission")
        model.release.set()
        if when == "pending":
            assert (await attacker.wait(evil, timeout_s=T)).status == "ok"
        result = await victim.wait(mine, timeout_s=T)
        assert (result.status, result.output) == ("ok", "the victim's input")
        polled = await victim.get_result("order-42")
        assert polled is not None
        assert polled.output == "the victim's input"
        again = await victim.submit("the victim's input", request_id="order-42")
        assert (await victim.wait(again, timeout_s=T)).output == "the victim's input"
    ran = [x for batch in model.batches for x in batch]
    assert "the forged input" not in ran
    figures = {k.decode(): int(v) for k, v in rclient.hgetall(keys.once_stats).items()}
    assert figures["conflict"] == 1
    assert rclient.xlen(keys.dead) == 0


@pytest.mark.slow
async def test_producer_rights_cannot_remove_other_producers_requests(
    urls: dict[str, str],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    queue: str,
) -> None:
    """200 requests of two producers wait, no worker yet; a third holder of the producer
    credentials tries every command that would remove or trim them (an XADD with MAXLEN 0
    deleted 200/200 before), then floods the inbox with junk. A worker starts: every one of
    the 200 is answered, the junk is dead-lettered."""
    common = {"queue": queue, "result_ttl_s": 120}
    async with (
        AsyncProducer(redis_url=urls["producer"], **common) as a,
        AsyncProducer(redis_url=urls["producer"], **common) as b,
    ):
        handles = [await p.submit(f"request {i}") for i in range(100) for p in (a, b)]
        assert await a.queue_depth() == 200
        thief = redis.Redis.from_url(urls["producer"])
        try:
            for stream in [*keys.streams, keys.cancels]:
                with pytest.raises(redis.exceptions.NoPermissionError):
                    thief.xadd(stream, {"x": "y"}, maxlen=0)
                with pytest.raises(redis.exceptions.NoPermissionError):
                    thief.xtrim(stream, maxlen=0)
            for attempt in (
                lambda: thief.delete(keys.inbox),
                lambda: thief.ltrim(keys.inbox, 0, 0),
                lambda: thief.lpop(keys.inbox, 200),
                lambda: thief.lset(keys.inbox, 0, "x"),
                lambda: thief.lmove(keys.inbox, keys.admitting),
                lambda: thief.expire(keys.inbox, 1),
            ):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    attempt()
            junk = [b"", b"\xc1", msgpack.packb(["r", 99, "id", "x"]), msgpack.packb({"a": 1})]
            junk += [msgpack.packb(["r", 1, "id", "ck-given", "meta", '"x"', "ck", "0" * 40])]
            thief.rpush(keys.inbox, *junk)
        finally:
            thief.close()
        start_worker(redis_url=urls["worker"], **common)
        results = [await p.wait(h, timeout_s=T) for h, p in zip(handles, [a, b] * 100, strict=True)]
    assert [r.output for r in results] == [f"request {i}" for i in range(100) for _ in (0, 1)]
    dead = rclient.xrange(keys.dead)
    assert len(dead) == len(junk)
    assert all(d[1][b"inbox"] == b"1" for d in dead)
    assert all(d[1][b"reason"].startswith(b"MalformedRequest: inbox element") for d in dead)


@pytest.mark.slow
async def test_a_forged_in_flight_mark_gets_the_coalesced_an_error_not_another_answer(
    redis_url: str, urls: dict[str, str], serve: Callable[..., dict[str, Any]], keys: QueueKeys
) -> None:
    model = GatedModel()
    common = serve(model, cache_ttl_s=60)
    # The script's mode: producers who may write these keys (here, a user with all rights).
    async with parties(urls["producer"], common, thief_url=redis_url) as (thief, attacker, victim):
        evil = await running(attacker, model)
        # A producer may SET in-flight marks (the enqueue script does): point the victim's
        # input at the attacker's running request.
        thief.set(keys.in_flight(cache_hash(MODEL_ID, hash_of("the victim's input"))), evil.id)
        mine = await victim.submit("the victim's input")
        assert victim.counts["coalesced"] == 1
        with_deadline = await victim.submit("the attacker's input", deadline_ms=600_000)
        assert victim.counts["queued"] == 1  # a request with a deadline is never coalesced
        # Admitted (coalesced onto the running request) before that one ends: a mark that
        # outlives its request's end is the forger's, which the strict rules forbid.
        wait_until(lambda: admitted(thief, keys), "their admission")
        model.release.set()
        result = await victim.wait(mine, timeout_s=T)
        assert (result.status, result.error_type) == ("error", "CoalesceMismatch")
        assert (await attacker.wait(evil, timeout_s=T)).output == "the attacker's input"
        assert (await victim.wait(with_deadline, timeout_s=T)).output == "the attacker's input"
    assert [x for batch in model.batches for x in batch] == ["the attacker's input"] * 2


@pytest.mark.slow
async def test_a_forged_cache_link_does_not_answer_a_guessable_id(
    redis_url: str,
    urls: dict[str, str],
    serve: Callable[..., dict[str, Any]],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    common = serve(cache_ttl_s=60)
    # The script's mode: producers who may write these keys (here, a user with all rights).
    async with parties(urls["producer"], common, thief_url=redis_url) as (thief, attacker, victim):
        assert await attacker.infer("the attacker's input", timeout_s=T) == "the attacker's input"
        cached = cache_hash(MODEL_ID, hash_of("the attacker's input"))
        assert rclient.exists(keys.cache(cached))
        # Before the victim submits its (guessable) id, the attacker links that id and the
        # victim's input to the cached answer of its own input.
        link = f"{hash_of('the victim input')} ={cached}"
        thief.set(keys.request_input("order-1"), link)
        output = await victim.infer("the victim input", request_id="order-1", timeout_s=T)
        assert output == "the victim input"
        assert victim.counts == Counter(queued=1)  # the script did not follow the link
        # A link the script made itself (a cache hit) is followed when the id comes again.
        hit = await victim.submit("the attacker's input")
        # (The hit's note reaches the admission a moment later: it links the id.)
        wait_until(lambda: rclient.exists(keys.request_input(hit.id)), "the hit's link")
        again = await victim.submit("the attacker's input", request_id=hit.id)
        assert (await victim.wait(again, timeout_s=T)).output == "the attacker's input"
        assert victim.counts == Counter(queued=1, cached=1, result=1)


def test_a_producer_runs_no_code_of_its_own_and_writes_no_key_of_answers(
    urls: dict[str, str], keys: QueueKeys, rclient: redis.Redis
) -> None:
    """No EVAL (a script that loops after one write could not be killed: SCRIPT KILL says
    UNKILLABLE, and it froze Redis for everyone), no SCRIPT, no FUNCTION; no write to a
    result, rid:, wait:, flight: or cache key or the model identity; and no GET of a reply
    stream (WRONGTYPE for one that exists told its name)."""
    rclient.xadd(keys.reply("someone"), {"n": "1"})
    thief = redis.Redis.from_url(urls["producer"])
    cache = keys.cache("0" * 40)
    try:
        for refused in (
            lambda: thief.eval("redis.call('SET', KEYS[1], 'x') while true do end", 1, cache),
            lambda: thief.script_load("return 1"),
            lambda: thief.function_load(
                "#!lua name=evil\nredis.register_function('e', function() while true do end end)"
            ),
            lambda: thief.set(cache, b"forged"),
            lambda: thief.delete(cache),
            lambda: thief.expire(cache, 1),
            lambda: thief.set(keys.model, "forged"),
            lambda: thief.set(keys.result("victim"), "forged"),
            lambda: thief.set(keys.request_input("victim"), "0" * 40),
            lambda: thief.delete(keys.request_input("victim")),
            lambda: thief.set(keys.in_flight("0" * 40), "victim"),
            lambda: thief.sadd(keys.waiters("victim"), "x y z"),
            lambda: thief.get(keys.reply("someone")),
            lambda: thief.get(keys.reply("nobody")),
            lambda: thief.xadd(keys.reply("someone"), {"r": "x"}),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
        assert thief.get(cache) is None  # reading is allowed (the enqueue function's look-up)
    finally:
        thief.close()


def test_a_producer_id_carries_128_random_bits(redis_url: str, queue: str) -> None:
    with (
        Producer(redis_url=redis_url, queue=queue) as one,
        Producer(redis_url=redis_url, queue=queue) as two,
    ):
        tails = [p.producer_id.rsplit("-", 1)[1] for p in (one, two)]
    assert [len(tail) for tail in tails] == [32, 32]
    assert tails[0] != tails[1]
    assert all(int(tail, 16) >= 0 for tail in tails)
