"""Forging results with producer rights: the producer and worker ACL users of docs/protocol.md,
created from the doc's own ``batchline acl`` lines, and every write a producer may make that
could have one request answered with another's result, no worker having computed it for
that request. Real Redis, workers in this process (a gated model whose batches the test
sees), the producers of the package (which check a result's input hash) and raw commands
(as a producer in another language sends them)."""

from __future__ import annotations

import contextlib
import shlex
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis

from batchline.acl import ROLES, acl_setuser
from batchline.codec import pack_value
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer, Handle
from batchline.transport._once import cache_hash, input_hash

from .conftest import RESULT_TIMEOUT_S, WorkerThread, wait_until
from .models_for_tests import GatedModel
from .test_protocol_doc import doc_block

T = RESULT_TIMEOUT_S
MODEL_ID = "m1"


def documented_lines() -> dict[str, list[str]]:
    """The doc's ``ACL SETUSER batchline-<role> ...`` lines, split as a shell would."""
    block = doc_block("acl", "exactly as `batchline acl` prints them")
    lines = {shlex.split(line)[2]: shlex.split(line) for line in block.splitlines()}
    assert set(lines) == {f"batchline-{role}" for role in ROLES}, block
    return {role: lines[f"batchline-{role}"] for role in ROLES}


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
def urls(acl_user: Callable[[list[str]], str], queue: str) -> dict[str, str]:
    """A URL per role, logged in as a user made from the doc's line for that role, the
    doc's queue ``default`` replaced by the test's."""
    made = {}
    for role, words in documented_lines().items():
        assert words[3:5] == ["reset", "on"], words
        rules = [w.replace("{default}", "{" + queue + "}") for w in words[5:]]
        made[role] = acl_user(["on", ">PASSWORD", *rules])
    return made


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
    url: str, common: dict[str, Any]
) -> AsyncIterator[tuple[redis.Redis, AsyncProducer, AsyncProducer]]:
    """With producer rights: a raw client (the forger's own commands), the forger's producer
    and the victim's."""
    thief = redis.Redis.from_url(url)
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
async def test_a_forged_waiter_gets_another_request_no_answer(
    urls: dict[str, str],
    serve: Callable[..., dict[str, Any]],
    keys: QueueKeys,
    caplog: pytest.LogCaptureFixture,
    cache_ttl_s: int,
) -> None:
    model = GatedModel()
    common = serve(model, cache_ttl_s=cache_ttl_s)
    async with parties(urls["producer"], common) as (thief, attacker, victim):
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


@pytest.mark.parametrize("version", ["2", "99"], ids=["valid", "malformed"])
async def test_an_entry_added_under_another_request_id_does_not_answer_it(
    urls: dict[str, str],
    serve: Callable[..., dict[str, Any]],
    rclient: redis.Redis,
    keys: QueueKeys,
    caplog: pytest.LogCaptureFixture,
    version: str,
) -> None:
    model = GatedModel()
    common = serve(model, cache_ttl_s=0)
    async with parties(urls["producer"], common) as (thief, attacker, victim):
        evil = await running(attacker, model)
        # A guessable id and the victim's reply stream. A valid forged entry, added first,
        # runs before the victim's; a malformed one (another schema version), added once the
        # victim waits, is dead-lettered as soon as it is read, its error pushed to the victim.
        forged = {"v": version, "id": "order-2", "meta": '"the forged input"'}
        forged["reply"] = victim.producer_id
        stream = keys.stream(victim.settings.default_priority)
        if version == "2":
            thief.xadd(stream, forged)
        mine = await victim.submit("the victim's input", request_id="order-2")
        if version != "2":
            thief.xadd(stream, forged)
            wait_until(lambda: rclient.xlen(keys.dead) == 1, "the forged entry's dead letter")
        model.release.set()
        result = await victim.wait(mine, timeout_s=T)
        assert (result.status, result.output) == ("ok", "the victim's input")
        assert result.input_hash == hash_of("the victim's input")
        assert (await attacker.wait(evil, timeout_s=T)).status == "ok"
    ran = ["the forged input"] if version == "2" else []
    assert [b[0] for b in model.batches] == ["the attacker's input", *ran, "the victim's input"]
    taken = [r.getMessage() for r in caplog.records if "another input" in r.getMessage()]
    assert len(taken) == 1, taken


async def test_a_forged_in_flight_mark_gets_the_coalesced_an_error_not_another_answer(
    urls: dict[str, str], serve: Callable[..., dict[str, Any]], keys: QueueKeys
) -> None:
    model = GatedModel()
    common = serve(model, cache_ttl_s=60)
    async with parties(urls["producer"], common) as (thief, attacker, victim):
        evil = await running(attacker, model)
        # A producer may SET in-flight marks (the enqueue script does): point the victim's
        # input at the attacker's running request.
        thief.set(keys.in_flight(cache_hash(MODEL_ID, hash_of("the victim's input"))), evil.id)
        mine = await victim.submit("the victim's input")
        assert victim.counts["coalesced"] == 1
        with_deadline = await victim.submit("the attacker's input", deadline_ms=600_000)
        assert victim.counts["queued"] == 1  # a request with a deadline is never coalesced
        model.release.set()
        result = await victim.wait(mine, timeout_s=T)
        assert (result.status, result.error_type) == ("error", "CoalesceMismatch")
        assert (await attacker.wait(evil, timeout_s=T)).output == "the attacker's input"
        assert (await victim.wait(with_deadline, timeout_s=T)).output == "the attacker's input"
    assert [x for batch in model.batches for x in batch] == ["the attacker's input"] * 2


async def test_a_forged_cache_link_does_not_answer_a_guessable_id(
    urls: dict[str, str],
    serve: Callable[..., dict[str, Any]],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    common = serve(cache_ttl_s=60)
    async with parties(urls["producer"], common) as (thief, attacker, victim):
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
        again = await victim.submit("the attacker's input", request_id=hit.id)
        assert (await victim.wait(again, timeout_s=T)).output == "the attacker's input"
        assert victim.counts == Counter(queued=1, cached=1, result=1)


def test_a_producer_cannot_write_the_cache_or_the_model_identity(
    urls: dict[str, str], keys: QueueKeys
) -> None:
    thief = redis.Redis.from_url(urls["producer"])
    key = keys.cache("0" * 40)
    try:
        for refused in (
            lambda: thief.set(key, b"forged"),
            lambda: thief.delete(key),
            lambda: thief.expire(key, 1),
            lambda: thief.set(keys.model, "forged"),
            lambda: thief.eval("return redis.call('SET', KEYS[1], 'x')", 1, key),
        ):
            with pytest.raises(redis.ResponseError, match="no permissions|user executing"):
                refused()
        assert thief.get(key) is None  # reading is allowed (the enqueue script's look-up)
    finally:
        thief.close()


def test_the_worker_line_cannot_write_the_cancel_stream_or_job_markers(
    urls: dict[str, str], keys: QueueKeys
) -> None:
    worker = redis.Redis.from_url(urls["worker"])
    try:
        for refused in (
            lambda: worker.xadd(keys.cancels, {"id": "x"}),
            lambda: worker.set(keys.job("x"), "1"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
    finally:
        worker.close()
