"""Streaming a generation over Redis: chunks pushed as tokens come, ``AsyncProducer.stream``
and ``Producer.stream``, cancel on leaving, re-runs deduplicated by token index, bounds.

Real Redis, real workers (in this process where the test holds the model's steps with the
gate, as processes where one is killed), the tiny random Llama of test_generate.py.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from batchline.codec import Limits, encode_request, unpack_result
from batchline.codec._requests import request_fields
from batchline.errors import InferenceError, RequestTimeout
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer, Producer, StreamChunk
from batchline.producer._stream import StreamState

from tests.e2e.test_reliability import assert_all_done
from tests.support.reply_spy import count_replies
from tests.support.scale_security import PREFIX, _acl_users
from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerProcess,
    WorkerThread,
    poll_result,
    spec,
    wait_until,
)
from tests.worker.test_generate import poll

pytest.importorskip("torch")
pytest.importorskip("transformers")

T = RESULT_TIMEOUT_S
TINY = spec("tiny_llama")
GATED = spec("tiny_llama_gated")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

# Greedy, of several lengths, with multi-byte text and a stop string; all run together.
VALUES: list[Any] = [
    {"prompt": "Once upon a time", "max_new_tokens": 40},
    {"prompt": "Über straße, ça va? 日本語", "max_new_tokens": 33},
    {"messages": CHAT, "max_new_tokens": 24},
    {"prompt": "Once upon a time", "max_new_tokens": 40, "stop": ["zz", "\x00iT"]},
    {"prompt": "x", "max_new_tokens": 1},
]
SAME = ("text", "tokens", "token_ids", "finish_reason", "prompt_tokens")  # not the timings
SEEDED = {"prompt": "0123456789", "max_new_tokens": 17, "temperature": 0.8, "top_k": 50, "seed": 7}


def joined(chunks: list[StreamChunk]) -> tuple[str, list[int]]:
    """The chunks' text and tokens put together, checking that their indexes follow on."""
    text, tokens = "", []
    for chunk in chunks:
        assert chunk.index == len(tokens), [(c.index, len(c.token_ids)) for c in chunks]
        text += chunk.text
        tokens += chunk.token_ids
    return text, tokens


def check_whole(chunks: list[StreamChunk]) -> dict[str, Any]:
    """One last chunk, at the end, whose result the chunks add up to; returns that result."""
    assert [c.finish_reason is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert all(c.result is None for c in chunks[:-1])
    result = chunks[-1].result
    assert result is not None
    assert chunks[-1].finish_reason == result["finish_reason"]
    assert joined(chunks) == (result["text"], result["token_ids"])
    return result


async def collect(producer: AsyncProducer, value: Any, **options: Any) -> list[StreamChunk]:
    return [chunk async for chunk in producer.stream(value, timeout_s=T, **options)]


@pytest.mark.slow
async def test_deltas_add_up_to_the_result_and_equal_infer(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    start_worker("generate", model_path=TINY, batch_size=3)
    values = [*VALUES, SEEDED, SEEDED]  # the seeded one twice, beside different others
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        streams = await asyncio.gather(*(collect(producer, v) for v in values))
        answers = await asyncio.gather(*(producer.infer(v, timeout_s=T) for v in values))
        with pytest.raises(InferenceError, match="BadGenerationParams"):  # as infer raises
            await collect(producer, {"prompt": "x", "top_p": 2})
    for value, chunks, answer in zip(values, streams, answers, strict=True):
        result = check_whole(chunks)
        assert [result[k] for k in SAME] == [answer[k] for k in SAME], value
        if result["tokens"] > 2:  # streamed: more than the last chunk
            assert len(chunks) > 1, value
    assert streams[3][-1].finish_reason == "stop"
    assert joined(streams[-1]) == joined(streams[-2])  # seeded: the same tokens again
    assert_all_done(rclient, keys)


@pytest.mark.slow
def test_a_worker_that_sends_no_chunks_streams_the_whole_text_at_the_end(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker of before streaming ignores the request's stream field; one without the
    field is what such a worker sees."""
    start_worker("generate", model_path=TINY)
    import batchline.producer._async as producer_module

    def without_stream(*args: Any, **kwargs: Any) -> tuple[list[Any], bytes, bytes]:
        flat, meta, blob = request_fields(*args, **kwargs)
        pairs = list(zip(flat[::2], flat[1::2], strict=True))
        popped.append(dict(pairs).get("stream"))
        return [x for name, value in pairs if name != "stream" for x in (name, value)], meta, blob

    popped: list[str | bytes | None] = []

    monkeypatch.setattr(producer_module, "request_fields", without_stream)
    with Producer(redis_url=redis_url, queue=queue) as producer:
        chunks = list(producer.stream(VALUES[0], timeout_s=T))
        answer = producer.infer(VALUES[0], timeout_s=T)
    assert popped == ["1", None]  # the stream asked for chunks, infer did not
    assert len(chunks) == 1
    assert chunks[0].index == 0
    result = check_whole(chunks)
    assert [result[k] for k in SAME] == [answer[k] for k in SAME]


@pytest.mark.slow
async def test_breaking_out_or_cancelling_the_task_cancels_the_request(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BLTEST_STEP_S", "0.01")  # 400 tokens: several seconds
    start_worker("generate", model_path=TINY)
    value = {"prompt": "abc", "max_new_tokens": 400}
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        async for _chunk in producer.stream(value, request_id="broke-off"):
            break  # the generator is finalized, and the request cancelled
        started = asyncio.Event()

        async def consume() -> None:
            async for _chunk in producer.stream(value, request_id="task-cancelled"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        results = [await poll_result(producer, rid) for rid in ("broke-off", "task-cancelled")]
    for r in results:
        assert r.output["finish_reason"] == "cancelled"
        assert r.output["tokens"] < 400


@pytest.mark.slow
def test_a_stream_past_its_timeout_raises_and_cancels_the_request(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str, gate: Any
) -> None:
    worker = start_worker("generate", model_path=GATED).worker
    with Producer(redis_url=redis_url, queue=queue) as producer:
        chunks = producer.stream("abc", request_id="too-slow", timeout_s=0.5)
        with pytest.raises(RequestTimeout):
            next(chunks)  # the gate holds its prefill
        wait_until(lambda: "too-slow" in worker._parts.cancels, "the worker to see the cancel")
        gate.open()
        r = poll(producer, "too-slow")
    assert (r.status, r.output["finish_reason"], r.output["tokens"]) == ("ok", "cancelled", 1)


def test_leaving_the_loop_cancels_the_request_within_a_step(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str, gate: Any
) -> None:
    worker = start_worker("generate", model_path=GATED).worker
    rid = "left-early"
    with Producer(redis_url=redis_url, queue=queue) as producer:
        gate.allow(3)  # the prefill and two decode steps
        for chunk in producer.stream({"prompt": "abc", "max_new_tokens": 200}, request_id=rid):
            assert (chunk.index, chunk.finish_reason) == (0, None)
            break  # the iterator is closed here: the request is cancelled
        wait_until(lambda: rid in worker._parts.cancels, "the worker to see the cancel")
        passes = gate.passes
        gate.open()
        r = poll(producer, rid)
    assert r.status == "ok"
    assert r.output["finish_reason"] == "cancelled"
    assert 1 <= r.output["tokens"] <= passes + 1  # the step under way, then no more


class Interrupted(Exception):
    """What the test's SIGINT handler raises in the main thread (as Ctrl-C would)."""


@pytest.mark.slow
def test_an_exception_while_the_next_chunk_is_pending_cancels_the_request(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str, gate: Any
) -> None:
    """Ctrl-C (here a signal whose handler raises) while ``Producer.stream`` waits for a
    chunk: the exception reaches the caller, and the request is cancelled."""
    worker = start_worker("generate", model_path=GATED).worker
    rid = "interrupted"

    def interrupt(_signum: int, _frame: Any) -> None:
        raise Interrupted

    def send_once_held() -> None:
        wait_until(lambda: worker._parts.executors.main.queue_size == 1, "the request to be held")
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        with Producer(redis_url=redis_url, queue=queue) as producer:
            sender = threading.Thread(target=send_once_held)
            sender.start()
            with pytest.raises(Interrupted):
                for _chunk in producer.stream("abc", request_id=rid, timeout_s=T):
                    pass  # the gate holds the prefill: no chunk comes
            sender.join()
            wait_until(lambda: rid in worker._parts.cancels, "the worker to see the cancel")
            gate.open()
            r = poll(producer, rid)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (r.status, r.output["finish_reason"]) == ("ok", "cancelled")


@pytest.mark.slow
def test_a_slow_consumer_leaves_nothing_in_redis_and_gets_what_came_at_once(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    gate: Any,
) -> None:
    start_worker("generate", model_path=GATED)
    with Producer(redis_url=redis_url, queue=queue) as producer:
        reply = keys.reply(producer.producer_id)
        value = {"prompt": "abc", "max_new_tokens": 30}
        chunks = producer.stream(value, request_id="slow-reader", timeout_s=T)
        gate.allow(1)
        got = [next(chunks)]  # the prefill's token
        gate.open()  # the rest is generated, streamed and answered while this caller waits
        poll(producer, "slow-reader")  # the result (pushed in the same script as its key)
        # The producer's reader has taken every chunk and the result off Redis all the same.
        wait_until(lambda: rclient.exists(reply) and rclient.xlen(reply) == 0, "the reads")
        got += list(chunks)
    assert [(c.index, len(c.token_ids)) for c in got] == [(0, 1), (1, 29)]  # at once
    assert check_whole(got)["tokens"] == 30


def ghost_request(rclient: redis.Redis, keys: QueueKeys, rid: str, max_new_tokens: int) -> Any:
    """Submit a streamed request for the producer ``ghost``, which never reads its reply
    stream, as a raw XADD; return its result (polled)."""
    fields = encode_request(
        rid,
        {"prompt": "abc", "max_new_tokens": max_new_tokens},
        enqueued_unix_ms=time.time() * 1e3,
        reply="ghost",
        stream=True,
    )
    rclient.xadd(keys.stream(0), fields)  # type: ignore[arg-type]
    raw = wait_until(lambda: rclient.get(keys.result(rid)), "the result", timeout_s=T)
    return unpack_result(raw, Limits()).output


@pytest.mark.slow
async def test_a_vanished_producer_stops_costing_the_worker(
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer that submitted a streamed request and went away without a word: once an
    entry of its reply stream is ``stream_max_unread_s`` old, the worker ends the request."""
    monkeypatch.setenv("BLTEST_STEP_S", "0.01")  # 400 tokens: 4 s at least
    start_worker("generate", model_path=TINY, stream_max_unread_s=0.2)
    output = ghost_request(rclient, keys, "ghost-1", 400)
    assert output["finish_reason"] == "cancelled"
    assert output["tokens"] < 400  # ended early
    reply = keys.reply("ghost")
    assert rclient.xlen(reply) < 400  # capped: the unread chunks and the result
    assert 0 < rclient.ttl(reply) <= 3600  # and it expires


@pytest.mark.slow
def test_a_reply_stream_full_of_fresh_entries_is_a_live_producers(
    start_worker: Callable[..., WorkerThread], rclient: redis.Redis, keys: QueueKeys
) -> None:
    """Entries unread for less than ``stream_max_unread_s``, however many (the results and
    chunks of many workers, during a pause of the producer's reader), cancel nothing."""
    start_worker("generate", model_path=TINY)
    with rclient.pipeline(transaction=False) as pipe:
        for i in range(1500):
            pipe.xadd(keys.reply("ghost"), {"r": b"\x90", "n": str(i)})
        pipe.execute()
    output = ghost_request(rclient, keys, "paused-1", 30)
    assert (output["finish_reason"], output["tokens"]) == ("length", 30)


@pytest.mark.slow
def test_a_worker_killed_mid_stream_is_rerun_and_no_token_shows_twice_or_never(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    resent: list[int] = []  # tokens that arrived a second time (the re-run's), and were dropped
    take = StreamState.take

    def spy(state: StreamState, chunk: Any) -> None:
        resent.append(max(0, min(len(state.tokens) - chunk.index, len(chunk.token_ids))))
        take(state, chunk)

    monkeypatch.setattr(StreamState, "take", spy)
    settings = dict(model_path=TINY, claim_idle_ms=1000, max_restarts_per_min=0)
    first = spawn_worker("generate", env={"BLTEST_STEP_S": "0.05"}, **settings)  # slow steps
    values = [{"prompt": "story 0", "max_new_tokens": 40}, {**SEEDED, "max_new_tokens": 40}]
    ids = ["killed-greedy", "killed-seeded"]
    with Producer(redis_url=redis_url, queue=queue) as producer:
        replies = count_replies(producer)
        streams = [producer.stream(v, request_id=rid, timeout_s=T) for v, rid in zip(values, ids)]
        got: list[list[StreamChunk]] = [[], []]
        for stream, chunks in zip(streams, got, strict=True):
            while sum(len(c.token_ids) for c in chunks) < 5:
                chunks.append(next(stream))
        first.signal(signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL
        streamed_before = [joined(chunks)[1] for chunks in got]
        second = spawn_worker("generate", **settings)
        for stream, chunks in zip(streams, got, strict=True):
            chunks += list(stream)
        answers = [producer.get_result(rid) for rid in ids]
        assert_all_done(rclient, keys)
        assert [replies[rid] for rid in ids] == [1, 1], replies
    assert sum(resent) >= 2 * 5  # the re-run streamed from the start: dropped, not shown
    for chunks, before, answer in zip(got, streamed_before, answers, strict=True):
        result = check_whole(chunks)  # every token once, in order
        assert answer is not None
        assert answer.worker == second.worker_id
        assert result == answer.output
        assert result["tokens"] == 40
        assert result["token_ids"][: len(before)] == before


async def holding(worker: Any, n: int, what: str) -> None:
    """Wait (off the event loop) until a generation worker holds ``n`` requests."""
    await asyncio.to_thread(wait_until, lambda: worker._parts.executors.main.queue_size == n, what)


async def check_as_infer(producer: AsyncProducer, value: Any, chunks: list[StreamChunk]) -> None:
    """The chunks add up to their result, which is what ``infer`` returns for ``value``."""
    result, answer = check_whole(chunks), await producer.infer(value, timeout_s=T)
    assert [result[k] for k in SAME] == [answer[k] for k in SAME]


@pytest.mark.slow
async def test_a_stream_goes_on_after_a_failed_chunk_write(
    acl_user: Callable[[list[str]], str],
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    gate: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The chunks of a write that fails (XADD refused to the worker's user) go with the
    next write: the producer gets its chunks on, not only the result."""
    url = acl_user(["on", ">PASSWORD", "~*", "&*", "+@all"])
    user = url.split("//", 1)[1].split(":", 1)[0]
    worker = start_worker("generate", model_path=GATED, redis_url=url).worker
    value = {"prompt": "Once upon a time", "max_new_tokens": 30}
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        chunks = producer.stream(value, timeout_s=T)
        first = asyncio.ensure_future(anext(chunks))
        await holding(worker, 1, "the request to be read")
        rclient.execute_command("ACL", "SETUSER", user, "-xadd")
        gate.allow(1)  # the prefill: its chunk is not written

        def refused() -> bool:
            failed = any("not written" in r.getMessage() for r in caplog.records)
            return failed and not worker._parts.chunks._outbox.busy

        await asyncio.to_thread(wait_until, refused, "a chunk write to fail")
        rclient.execute_command("ACL", "SETUSER", user, "+xadd")
        gate.allow(1)  # a decode step: its chunk goes with the one not written
        got = [await asyncio.wait_for(first, T)]
        assert (got[0].index, len(got[0].token_ids), got[0].finish_reason) == (0, 2, None)
        gate.open()
        got += [chunk async for chunk in chunks]
        await check_as_infer(producer, value, got)


@pytest.mark.slow
async def test_chunks_of_an_entry_forged_under_a_streamed_id_never_reach_its_stream(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    gate: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Another producer adds an entry under a streamed request's id and reply stream, asking
    for chunks, with its own prompt: it runs beside the real one, and its chunks reach the
    victim's producer, which refuses them by their input hash (as it refuses such a
    result): the stream shows the victim's generation alone, whole."""
    worker = start_worker("generate", model_path=GATED, batch_size=2).worker
    value = {"prompt": "Once upon a time", "max_new_tokens": 30}
    async with AsyncProducer(redis_url=redis_url, queue=queue) as victim:
        stream = collect(victim, value, request_id="order-2")
        chunks = asyncio.ensure_future(stream)
        # The victim's entry is queued (its prefill held by the gate); then the forged one.
        await holding(worker, 1, "the victim's request")
        prio = victim.settings.default_priority
        forged = encode_request(
            "order-2",
            {"prompt": "zzzz forged text", "max_new_tokens": 40},
            priority=prio,
            enqueued_unix_ms=time.time() * 1e3,
            reply=victim.producer_id,
            stream=True,
        )
        rclient.xadd(keys.stream(prio), forged)  # type: ignore[arg-type]
        await holding(worker, 2, "the forged request")
        gate.open()
        got = await chunks
        assert len(got) > 1  # chunks came before the result
        await check_as_infer(victim, value, got)
    refused = [r.getMessage() for r in caplog.records if "another input" in r.getMessage()]
    assert any("a chunk of request order-2" in m for m in refused), refused


@pytest.mark.slow
def test_a_stream_under_the_producer_and_worker_acl_users(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    gate: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """batchline.acl's users allow all a stream does: the worker's chunk writes (XADD,
    EXPIRE, XLEN on the reply stream), the producer's reads and deletes, its cancel."""
    caplog.set_level(logging.WARNING)  # a refused chunk write is only logged
    keys = QueueKeys(queue, PREFIX)
    users = _acl_users(rclient, redis_url, keys, queue[-8:])
    as_user = {"queue": queue, "prefix": PREFIX}
    thread = start_worker("generate", model_path=GATED, redis_url=users["worker"][0], **as_user)
    try:
        with Producer(redis_url=users["producer"][0], **as_user) as producer:
            gate.open()
            chunks = list(producer.stream(VALUES[0], timeout_s=T))
            assert len(chunks) > 1  # chunks came before the result
            assert check_whole(chunks)["text"] == producer.infer(VALUES[0], timeout_s=T)["text"]
            gate.close()
            gate.allow(3)  # the prefill and two decode steps
            for _chunk in producer.stream({"prompt": "abc", "max_new_tokens": 200}, request_id="a"):
                break  # the iterator is closed here: the request is cancelled
            wait_until(lambda: "a" in thread.worker._parts.cancels, "the worker to see the cancel")
            gate.open()
            assert poll(producer, "a").output["finish_reason"] == "cancelled"
        thread.stop()  # before its user goes
    finally:
        for role in ("producer", "worker"):
            rclient.execute_command("ACL", "DELUSER", f"blq-{role}-{queue[-8:]}")
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_stream_that_diverged_raises_and_leaves_its_rerun_running(
    redis_url: str, queue: str, rclient: redis.Redis, keys: QueueKeys
) -> None:
    """A re-run that generates otherwise than the attempt whose tokens were streamed (a
    worker died, the re-run sampled anew) raises StreamDiverged to the caller, and the
    request is not cancelled: the re-run goes on, its whole result in the result key.
    (Chunks written here as the two attempts' workers would.)"""
    from batchline.codec._chunks import Chunk, pack_chunks
    from batchline.errors import StreamDiverged

    from tests.support.replies_by_hand import eventually

    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        reply = keys.reply(producer.producer_id)
        stream = producer.stream({"prompt": "hi", "max_new_tokens": 8}, request_id="div-1")
        first = asyncio.ensure_future(anext(stream))
        # Its stream is followed once its request is written (no worker: it waits there).
        await eventually(
            lambda: rclient.llen(keys.inbox) + sum(rclient.xlen(s) for s in keys.streams),
            "the request written",
        )
        rclient.xadd(reply, pack_chunks([Chunk("div-1", 0, 0, "ab", [10, 11])]))  # type: ignore[arg-type]
        assert (await asyncio.wait_for(first, 30)).token_ids == [10, 11]
        rclient.xadd(reply, pack_chunks([Chunk("div-1", 0, 0, "ac", [10, 12])]))  # type: ignore[arg-type]
        with pytest.raises(StreamDiverged):
            await asyncio.wait_for(anext(stream), 30)
    # (the producer's close waits for the cancels it sends)
    assert rclient.xlen(keys.cancels) == 0
    assert not [e for e in rclient.lrange(keys.inbox, 0, -1) if e.startswith(b"\x92\xa1c")]
