"""Answers cut short (cancelled, expired, a generation ended by a cancel or its deadline) are
never cached nor given to requests coalesced onto them, and do not settle their id: a
resubmit runs again, and a cancel covers only the attempts added before it.

Real Redis, real workers in this process: a gated echo model, whose batches the test sees,
and the tiny random Llama whose forward passes the test lets through one at a time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis

from batchline.codec import Result, pack_value
from batchline.errors import RequestCancelled
from batchline.keys import GROUP, QueueKeys
from batchline.producer import AsyncProducer, Handle
from batchline.transport import COMPLETE, LIBRARY, input_hash

from .test_once import cached, computed, entries_added, queue_keys
from .test_replies import complete_args, packed_with, reply_entries
from tests.support.models_for_tests import GatedModel
from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerThread,
    admit_inbox,
    admitted,
    pending_count,
    poll_result,
    spec,
    wait_until,
)

T = RESULT_TIMEOUT_S
HUGE_MS = 600_000.0  # a batch timeout that never fires: batches flush by size
GATED = spec("tiny_llama_gated")


async def until(what: str, check: Callable[[], Any]) -> None:
    await asyncio.to_thread(wait_until, check, what)


@pytest.fixture(params=["functions", "scripts"])
async def both(
    request: pytest.FixtureRequest, redis_url: str, queue: str
) -> AsyncIterator[list[AsyncProducer]]:
    """Two producers of the test's queue with the cache on (60 s), admitted through the
    queue's functions, then through the enqueue script."""
    admission = request.param
    async with (
        AsyncProducer(redis_url=redis_url, queue=queue, cache_ttl_s=60, admission=admission) as a,
        AsyncProducer(redis_url=redis_url, queue=queue, cache_ttl_s=60, admission=admission) as b,
    ):
        yield [a, b]


def admit(producer: AsyncProducer, client: redis.Redis, keys: QueueKeys) -> None:
    """With the functions and no worker running: admit the inbox, as a worker would."""
    if producer.settings.admission == "functions":
        admit_inbox(client, keys)


async def ran_once(rid: str, *waiting: tuple[AsyncProducer, Handle]) -> Result:
    """What each producer's handle gets: the answer of "the order" under ``rid``; returns it."""
    got = [await producer.wait(handle, timeout_s=T) for producer, handle in waiting]
    for result in got:
        assert (result.id, result.status, result.output) == (rid, "ok", "the order")
    return got[-1]


async def cut_short(
    start_worker: Callable[..., WorkerThread],
    producer: AsyncProducer,
    *ids: str,
    model: GatedModel | None = None,
    **settings: Any,
) -> WorkerThread:
    """Submit "the order" under each id and cancel it before a worker starts; start one
    (``model``, ``settings``), which answers each ``cancelled``: cut short, marked to run
    again. (With a deadline: none is coalesced onto another, whose rerun that cancel would
    not cover.)"""
    for rid in ids:
        handle = await producer.submit("the order", request_id=rid, deadline_ms=HUGE_MS)
        await producer.cancel(handle)
    worker = start_worker(model or GatedModel(), **settings)
    for rid in ids:
        assert (await poll_result(producer, rid)).status == "cancelled"
    return worker


async def test_a_cancelled_request_gets_its_coalesced_requests_run_for_themselves(
    cached: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    a, b = cached
    model = GatedModel()
    worker = start_worker(model, batch_size=1, timeout_ms=HUGE_MS, cache_ttl_s=60).worker
    await until("the model identity", lambda: rclient.exists(keys.model))
    blocker = await a.submit("blocker")  # holds the model: what follows waits in the worker
    assert await asyncio.to_thread(model.entered.wait, T)
    leader = await a.submit("same text")  # a miss: queued, marked in flight
    joined = await b.submit("same text")  # coalesced onto it
    poller = await b.submit("same text", reply=False)  # coalesced, without a reply stream
    assert (b.counts["coalesced"], entries_added(rclient, keys)) == (2, [0, 2, 0])
    await until("the worker to hold both", lambda: pending_count(rclient, keys) == 2)
    await a.cancel(leader)
    await until("the cancel to reach the worker", lambda: leader.id in worker._parts.cancels)
    model.release.set()
    assert await a.result(blocker, timeout_s=T) == "blocker"
    first = await poll_result(a, leader.id)
    assert first.status == "cancelled"
    # The coalesced requests ran for themselves: one new entry, computed once for both.
    result = await b.wait(joined, timeout_s=T)
    assert (result.id, result.status, result.output) == (joined.id, "ok", "same text")
    polled = await poll_result(b, poller.id)
    assert (polled.id, polled.status, polled.output) == (poller.id, "ok", "same text")
    assert computed(model) == ["blocker", "same text"]
    assert entries_added(rclient, keys) == [0, 3, 0]
    # That complete answer, not the cancelled one, is what the cache holds now.
    hit = await a.submit("same text")
    assert a.counts["cached"] == 1
    assert (await a.wait(hit, timeout_s=T)).output == "same text"
    assert len(queue_keys(rclient, keys, "cache")) == 2  # "blocker" and "same text"
    assert queue_keys(rclient, keys, "flight") == queue_keys(rclient, keys, "wait") == []


@pytest.mark.parametrize("how", ["cancelled", "expired"])
@pytest.mark.slow
async def test_a_resubmit_after_a_cancel_or_an_expiry_runs_again(
    cached: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    how: str,
) -> None:
    """Time out, cancel, retry with the same id: the retry runs and answers (before, it got
    the cancelled outcome back for result_ttl_s); the old cancel does not cover it."""
    a, _b = cached
    model = GatedModel()
    worker = start_worker(model, batch_size=1, timeout_ms=HUGE_MS).worker
    blocker = await a.submit("blocker")
    assert await asyncio.to_thread(model.entered.wait, T)
    rid = "order-42"
    if how == "cancelled":
        first = await a.submit("the order", request_id=rid)
        await until("the worker to hold it", lambda: pending_count(rclient, keys) == 2)
        await a.cancel(first)
        await until("the cancel to reach the worker", lambda: rid in worker._parts.cancels)
    else:
        first = await a.submit("the order", request_id=rid, deadline_ms=200)
        await asyncio.sleep(0.3)  # its deadline passes while the model is held
    model.release.set()
    assert await a.result(blocker, timeout_s=T) == "blocker"
    assert (await poll_result(a, rid)).status == how
    assert rclient.get(keys.request_input(rid)).endswith(b" !")  # cut short: not settled
    again = await a.submit("the order", request_id=rid)
    assert a.counts["result"] == 0  # not the stored outcome: queued again
    result = await a.wait(again, timeout_s=T)
    assert (result.id, result.status, result.output) == (rid, "ok", "the order")
    assert computed(model) == ["blocker", "the order"]
    # Now settled: a further resubmit gets that answer without running.
    third = await a.wait(await a.submit("the order", request_id=rid), timeout_s=T)
    assert (third.status, a.counts["result"]) == ("ok", 1)
    assert await a.get_result(rid) == result


async def test_while_a_cut_short_id_runs_again_its_cancelled_answer_is_gone(
    both: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    """The rerun's resubmits attach to it and a poll finds no result, not the cut-short
    answer the rerun replaces; then every caller gets the rerun's answer."""
    a, b = both
    rid = "order-42"
    (await cut_short(start_worker, a, rid)).stop()
    again = await a.submit("the order", request_id=rid)  # no worker: the rerun stays queued
    admit(a, rclient, keys)
    assert a.counts["result"] == 0
    assert rclient.exists(keys.result(rid)) == 0
    assert await a.get_result(rid) is None
    [entry] = [e for s in keys.streams for e, _f in rclient.xrange(s)]
    assert rclient.get(keys.request_input(rid)).endswith(b" @" + entry)  # the rerun's
    joined = await b.submit("the order", request_id=rid)
    assert (b.counts["attached"], b.counts["result"]) == (1, 0)
    admit(b, rclient, keys)
    model = GatedModel()
    model.release.set()
    start_worker(model)
    result = await ran_once(rid, (a, again), (b, joined))
    assert await a.get_result(rid) == result


# With the script a cancel goes straight to the cancel stream: nothing marks the id before
# the worker's answer does.
@pytest.mark.parametrize("both", ["functions"], indirect=True)
async def test_a_cancel_of_the_rerun_of_a_cut_short_id_marks_it_to_run_again(
    both: list[AsyncProducer],
    rclient: redis.Redis,
    keys: QueueKeys,
    start_worker: Callable[..., WorkerThread],
) -> None:
    """The rerun, cancelled too, is not answered yet: its id is marked as the cancel is
    admitted, so a resubmit after that cancel runs it again, rather than attaching to the
    cancelled one."""
    a, _b = both
    rid = "order-42"
    (await cut_short(start_worker, a, rid)).stop()
    again = await a.submit("the order", request_id=rid)
    admit_inbox(rclient, keys)
    await a.cancel(again)
    admit_inbox(rclient, keys)
    assert rclient.get(keys.request_input(rid)).endswith(b" !")
    await a.submit("the order", request_id=rid)
    admit_inbox(rclient, keys)
    assert sum(len(rclient.xrange(s)) for s in keys.streams) == 2  # both reruns queued


async def test_a_cut_short_id_answered_from_the_cache_or_coalesced_loses_its_cut_short_answer(
    both: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    """A resubmit of a cut-short id coalesced onto another request of its input gets that
    request's answer (its result key, which held the cut-short answer, is written now), and
    one answered from the cache links its id to the cached answer, which a poll then finds."""
    a, b = both
    model = GatedModel()
    await cut_short(start_worker, a, "joins", "hits", model=model, cache_ttl_s=60, batch_size=1)
    leader = await b.submit("the order")  # another id, the same input: in the model, held
    assert await asyncio.to_thread(model.entered.wait, T)
    joined = await a.submit("the order", request_id="joins")
    assert a.counts["coalesced"] == 1
    await until("its admission", lambda: admitted(rclient, keys))
    model.release.set()
    assert (await b.wait(leader, timeout_s=T)).output == "the order"
    result = await a.wait(joined, timeout_s=T)
    assert (result.id, result.status, result.output) == ("joins", "ok", "the order")
    hit = await a.submit("the order", request_id="hits")
    assert a.counts["cached"] == 1
    assert (await a.wait(hit, timeout_s=T)).status == "ok"
    await until("its note's admission", lambda: admitted(rclient, keys))
    for rid in ("joins", "hits"):
        polled = await a.get_result(rid)
        assert polled is not None
        assert (polled.id, polled.status, polled.output) == (rid, "ok", "the order")
    assert computed(model) == ["the order"]


@pytest.fixture
def through_functions(redis_url: str, queue: str) -> Callable[[str], Any]:
    """Cancel an id as a producer that uses the queue's functions does: the admission marks
    it to run again (a cancel with the script goes to the cancel stream, marking nothing)."""

    async def cancel(rid: str) -> None:
        async with AsyncProducer(redis_url=redis_url, queue=queue, admission="functions") as c:
            await c.cancel(rid)

    return cancel


async def held_then_cancelled(
    start_worker: Callable[..., WorkerThread],
    producer: AsyncProducer,
    cancel: Callable[[], Any],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> tuple[GatedModel, Handle]:
    """Start a worker whose model holds a blocker; submit "the order" (id order-42), which the
    worker takes, then ``cancel()`` it: the cancel reaches the worker, which will answer it
    cancelled once the gate opens, and the id is marked to run again. Returns the model and
    the request's handle."""
    model = GatedModel()
    worker = start_worker(model, batch_size=1, timeout_ms=HUGE_MS).worker
    await producer.submit("blocker")
    assert await asyncio.to_thread(model.entered.wait, T)
    first = await producer.submit("the order", request_id="order-42")
    await until("the worker to hold it", lambda: pending_count(rclient, keys) == 2)
    await cancel()
    await until("the cancel to reach the worker", lambda: "order-42" in worker._parts.cancels)
    await until("the cancel's admission", lambda: marked(rclient, keys, "order-42") == b"!")
    return model, first


def marked(client: redis.Redis, keys: QueueKeys, rid: str) -> bytes | None:
    """The mark of an id's rid: key (b"!", b"@" ...), None without one."""
    known = client.get(keys.request_input(rid))
    return known[41:42] if known else None


async def test_time_out_cancel_retry_with_the_same_id_gets_the_retry_s_answer(
    both: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    through_functions: Callable[[str], Any],
) -> None:
    """The retry runs as a newer attempt while the worker still holds the cancelled one,
    whose cut-short answer comes first: it goes to no one (this producer's reply stream is
    the retry's too, and the callers attached to the retry wait on the id's waiters), and
    the retry, and a caller attached to it, get the retry's answer."""
    a, b = both
    rid = "order-42"

    async def cancel() -> None:
        if a.settings.admission == "functions":
            await a.cancel(rid)  # the producer's own: the caller timed out
        else:  # with the script, through the functions of another producer
            await through_functions(rid)

    model, _first = await held_then_cancelled(start_worker, a, cancel, rclient, keys)
    again = await a.submit("the order", request_id=rid)
    await until("the retry's admission", lambda: marked(rclient, keys, rid) == b"@")
    joined = await b.submit("the order", request_id=rid)
    assert b.counts["attached"] == 1
    await until("its admission", lambda: admitted(rclient, keys))
    model.release.set()
    result = await ran_once(rid, (a, again), (b, joined))
    assert computed(model) == ["blocker", "the order"]
    assert await a.get_result(rid) == result


@pytest.mark.parametrize("cache_ttl_s", [0, 60], ids=["no cache", "cache"])
async def test_a_retry_admitted_with_the_cancel_of_its_first_attempt_runs(
    redis_url: str,
    queue: str,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    cache_ttl_s: int,
) -> None:
    """Submit, cancel and retry at once: all three wait in the inbox and are admitted in
    one call, the retry stamped (ts, the producer's clock) before the cancel was admitted.
    The cancel covers the first attempt alone: the retry runs and answers. With the cache
    on, the first attempt's in-flight mark names the id itself: the retry is not coalesced
    onto its own cancelled attempt (nothing would answer it)."""
    rclient.function_load(LIBRARY, replace=True)
    rclient.set(keys.model, "m1")
    async with AsyncProducer(
        redis_url=redis_url, queue=queue, admission="functions", cache_ttl_s=cache_ttl_s
    ) as a:
        rid = "order-42"
        first = await a.submit("the order", request_id=rid)
        await a.cancel(first)
        again = await a.submit("the order", request_id=rid)
        assert rclient.llen(keys.inbox) == 3  # nothing admitted yet
        admit_inbox(rclient, keys, cache_ttl_s=cache_ttl_s)
        added = [f for s in keys.streams for _e, f in rclient.xrange(s)]
        assert [f[b"id"] for f in added] == [rid.encode()] * 2
        assert b"ca" not in added[0]
        assert b"ca" in added[1]  # the retry: admitted after the cancel
        model = GatedModel()
        model.release.set()
        start_worker(
            model, batch_size=1, timeout_ms=HUGE_MS, cache_ttl_s=cache_ttl_s, model_id="m1"
        )
        result = await a.wait(again, timeout_s=T)
        assert (result.status, result.output) == ("ok", "the order")
        assert computed(model) == ["the order"]  # the first attempt, cancelled, did not run


async def test_a_caller_of_an_attempt_cut_short_after_a_retry_gets_the_retry_s_answer(
    through_functions: Callable[[str], Any],
    both: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    """Cancelled by someone else and retried by another producer, the first attempt's
    answer reaches no one: its own caller, still waiting, joins the id's waiters and gets
    the retry's answer."""
    a, b = both
    rid = "order-42"
    model, first = await held_then_cancelled(
        start_worker, a, lambda: through_functions(rid), rclient, keys
    )
    again = await b.submit("the order", request_id=rid)
    await until("the retry's admission", lambda: marked(rclient, keys, rid) == b"@")
    model.release.set()
    retried = await ran_once(rid, (b, again))
    assert await a.wait(first, timeout_s=T) == retried
    assert computed(model) == ["blocker", "the order"]


async def cancelled_then_retried(
    a: AsyncProducer, rclient: redis.Redis, keys: QueueKeys, *, token: bool = True
) -> tuple[Handle, str]:
    """Time out, cancel, retry at once, on the functions path, the race made deterministic:
    "the order" (id order-42) is admitted and taken by a worker (by hand), cancelled (the
    cancel admitted: the id marked), and resubmitted; before the retry is admitted, the
    worker answers the first attempt ``cancelled`` (with its entry's attempt token, as a
    worker of this release writes it; ``token`` False: without one, as an earlier one does),
    which still holds the id: pushed to this producer, whose retry waits. Then the retry is
    admitted. Returns the retry's handle and its entry's attempt token."""
    rid, stream = "order-42", keys.stream(1)
    rclient.xgroup_create(stream, GROUP, id="0", mkstream=True)
    first = await a.submit("the order", request_id=rid)
    admit_inbox(rclient, keys)
    [(_s, [(entry, fields)])] = rclient.xreadgroup(GROUP, "w1", {stream: ">"})
    await a.cancel(first)
    admit_inbox(rclient, keys)
    assert marked(rclient, keys, rid) == b"!"
    again = await a.submit("the order", request_id=rid)  # in the inbox: not admitted yet
    h = input_hash(*pack_value("the order"))
    attempt = {"at": fields[b"at"].decode()} if token and b"at" in fields else {}
    cut = packed_with(Result(rid, "cancelled", worker="w1"), ih=h, **attempt)
    record = [1, entry.decode(), rid, a.producer_id, cut, 4, h, "", "", "cut"]
    args = [*complete_args(keys, [record]), int(time.time() * 1e3)]
    script = rclient.register_script(COMPLETE)
    assert script(keys=[*keys.streams_low_first, keys.dead], args=args) == 1
    reply = keys.reply(a.producer_id)
    await until("the producer to read the answer", lambda: rclient.xlen(reply) == 0)
    # A cancel covers the entries added in its millisecond: the retry's comes after it.
    [(cancel_id, _f)] = rclient.xrevrange(keys.cancels, count=1)
    cancel_ms = int(cancel_id.split(b"-")[0])
    await until("a later millisecond", lambda: int(rclient.time()[0] * 1e3) > cancel_ms + 1)
    admit_inbox(rclient, keys)
    [(_retry, retry_fields)] = rclient.xrange(stream, min=f"({entry.decode()}")
    assert marked(rclient, keys, rid) == b"@"
    return again, retry_fields.get(b"at", b"").decode()


@pytest.mark.parametrize("both", ["functions"], indirect=True)
@pytest.mark.parametrize("then", ["runs", "cancelled"])
async def test_a_retry_sent_before_the_cancelled_attempt_s_answer_gets_its_own(
    both: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    then: str,
) -> None:
    """The cancelled attempt's answer, pushed while the retry waits (same id, same input),
    is not the retry's: it carries the first attempt's token. The retry's caller gets the
    retry's answer, which carries the retry's token; and nothing waits for ever: a retry
    cancelled in turn by another producer gets its own ``cancelled``."""
    a, b = both
    again, token = await cancelled_then_retried(a, rclient, keys)
    assert again._future is not None
    assert not again._future.done()  # still waiting: the cancelled answer was not taken
    if then == "cancelled":
        await b.cancel("order-42")
        admit_inbox(rclient, keys)  # (a worker reads the cancels before it serves)
    model = GatedModel()
    model.release.set()
    start_worker(model)
    result = await a.wait(again, timeout_s=T)
    assert (result.id, result.attempt) == ("order-42", token)
    assert token != ""
    if then == "cancelled":
        assert result.status == "cancelled"
        with pytest.raises(RequestCancelled):
            result.unwrap()
        assert computed(model) == []
    else:
        assert (result.status, result.output) == ("ok", "the order")
        assert computed(model) == ["the order"]


@pytest.mark.parametrize("both", ["functions"], indirect=True)
async def test_an_answer_without_an_attempt_token_reaches_its_waiter_as_before(
    both: list[AsyncProducer], rclient: redis.Redis, keys: QueueKeys
) -> None:
    """A worker of an earlier release writes no ``at``: its answer is matched by id and input
    hash alone, as before (docs/protocol.md, Rolling upgrades: the retry takes the cancelled
    attempt's answer), and so never left unanswered."""
    a, _b = both
    again, _token = await cancelled_then_retried(a, rclient, keys, token=False)
    with pytest.raises(RequestCancelled):
        await a.result(again, timeout_s=T)


def test_a_call_made_again_gives_a_superseded_cut_short_answer_to_no_one_either(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    """After a failure the worker calls the completion script again, which gives each answer
    again as the first call did: a cut-short one whose id a newer attempt holds is not pushed
    to its producer, who waits with the id's waiters, or gets the newer attempt's answer
    once that is stored."""
    rid, stream = "order-42", keys.stream(1)
    meta, blob = pack_value("the order")
    h = input_hash(meta, blob)
    rclient.xgroup_create(stream, GROUP, id="0", mkstream=True)
    fields = {"v": "2", "id": rid, "meta": meta, "reply": "p1"}
    first = rclient.xadd(stream, fields).decode()  # type: ignore[arg-type]
    rclient.xreadgroup(GROUP, "w1", {stream: ">"})
    newer = rclient.xadd(stream, fields).decode()  # type: ignore[arg-type]
    rclient.set(keys.request_input(rid), f"{h} @{newer}")
    cut = packed_with(Result(rid, "cancelled", worker="w1"), ih=h)
    record = [1, first, rid, "p1", cut, 4, h, "", "", "cut"]
    script = rclient.register_script(COMPLETE)

    def complete(again: str) -> int:
        args = [*complete_args(keys, [record]), int(time.time() * 1e3), "0", again]
        return int(script(keys=[*keys.streams_low_first, keys.dead], args=args))

    assert complete("0") == 1
    assert complete("1") == 0  # acknowledged already
    assert reply_entries(rclient, keys.reply("p1")) == []
    assert rclient.smembers(keys.waiters(rid)) == {f"{rid} p1 {h}".encode()}
    assert rclient.exists(keys.result(rid)) == 0
    answer = Result(rid, "ok", "the order", worker="w2")
    rclient.set(keys.result(rid), packed_with(answer, ih=h))
    complete("1")
    [(_n, [pushed])] = reply_entries(rclient, keys.reply("p1"))
    assert (pushed.status, pushed.output, pushed.worker) == ("ok", "the order", "w2")


def test_a_superseded_answer_and_the_newer_one_in_one_call_reach_both_callers(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    """The cut-short answer of an attempt a newer one holds, then the newer one's answer,
    in one call of the completion script: the first attempt's caller, joined to the id's
    waiters by the first record, is answered by the second."""
    rid, stream = "order-42", keys.stream(1)
    meta, _blob = pack_value("the order")
    h = input_hash(meta, b"")
    rclient.xgroup_create(stream, GROUP, id="0", mkstream=True)
    first = rclient.xadd(stream, {"v": "2", "id": rid, "meta": meta, "reply": "pA"}).decode()
    newer = rclient.xadd(stream, {"v": "2", "id": rid, "meta": meta, "reply": "pB"}).decode()
    rclient.xreadgroup(GROUP, "w1", {stream: ">"})
    rclient.set(keys.request_input(rid), f"{h} @{newer}")
    cut = packed_with(Result(rid, "cancelled", worker="w1"), ih=h)
    ok = packed_with(Result(rid, "ok", "the order", worker="w1"), ih=h)
    records = [
        [1, first, rid, "pA", cut, 4, h, "", "", "cut"],
        [1, newer, rid, "pB", ok, 4, h, "", "", "ok"],
    ]
    script = rclient.register_script(COMPLETE)
    args = [*complete_args(keys, records), int(time.time() * 1e3), "0", "0"]
    assert int(script(keys=[*keys.streams_low_first, keys.dead], args=args)) == 2
    for producer in ("pA", "pB"):
        [(_n, [pushed])] = reply_entries(rclient, keys.reply(producer))
        assert (pushed.status, pushed.output) == ("ok", "the order"), producer
    assert rclient.exists(keys.waiters(rid)) == 0


@pytest.mark.slow
async def test_a_generation_cut_short_is_never_cached_nor_given_to_coalesced_requests(
    cached: list[AsyncProducer],
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    gate: Any,
) -> None:
    """A streamed chat whose client hangs up after two chunks ends "cancelled": the next
    identical request gets a whole generation, not those few tokens; nor does a request
    coalesced onto it, nor one after a generation ended by its deadline."""
    a, b = cached
    worker = start_worker("generate", model_path=GATED, cache_ttl_s=60).worker
    await until("the model identity", lambda: rclient.exists(keys.model))
    value = {"prompt": "Once upon a time", "max_new_tokens": 40}
    gate.allow(3)  # the prefill and two decode steps
    chunks = a.stream(value, request_id="hung-up", timeout_s=T)
    got = [await anext(chunks), await anext(chunks)]
    joined = await b.submit(value)  # coalesced onto the running one
    assert b.counts["coalesced"] == 1
    await chunks.aclose()  # the client hangs up: the request is cancelled
    await until("the worker to see the cancel", lambda: "hung-up" in worker._parts.cancels)
    gate.open()
    cut = await poll_result(a, "hung-up")
    assert (cut.status, cut.output["finish_reason"]) == ("ok", "cancelled")
    assert cut.output["tokens"] < 40
    assert [c.index for c in got] == [0, 1]
    whole = await b.wait(joined, timeout_s=T)
    assert (whole.output["finish_reason"], whole.output["tokens"]) == ("length", 40)
    assert whole.output["token_ids"][: cut.output["tokens"]] == cut.output["token_ids"]
    again = await a.infer(value, timeout_s=T)  # from the cache: the whole one
    assert a.counts["cached"] == 1
    assert again["token_ids"] == whole.output["token_ids"]
    # A generation ended by its deadline: never cached either.
    other = {"prompt": "Another one", "max_new_tokens": 40}
    gate.close()
    start = gate.passes
    gate.allow(2)
    late = await a.submit(other, deadline_ms=1000)
    await until("two steps", lambda: gate.passes == start + 2)
    await asyncio.sleep(1.1)  # its deadline passes while the next step is held
    gate.open()
    ended = await a.wait(late, timeout_s=T)
    assert (ended.status, ended.output["finish_reason"]) == ("ok", "deadline")
    fresh = await a.infer(other, timeout_s=T)
    assert (fresh["finish_reason"], fresh["tokens"]) == ("length", 40)
    assert a.counts["cached"] == 1  # ran again, not served the cut-short one
    assert len(queue_keys(rclient, keys, "cache")) == 2


__all__ = ["cached"]  # the fixture, shared with test_once
