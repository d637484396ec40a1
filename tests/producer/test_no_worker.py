"""No silent wait: a request waiting on a queue that no live worker serves is said in the
producer's log within ``no_worker_log_s``, then again at doubling intervals, with or without
a ``timeout_s``, from the blocking Producer, ``infer``, ``wait`` and ``stream`` alike, with
a command that starts a worker for that queue on that Redis (its URL where it is not the
default, its password never); and the requests that live workers answer in time cost no Redis
command for it."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from batchline.errors import RequestTimeout
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer, Producer

from tests.support.models_for_tests import GatedModel
from tests.support.service import WorkerThread, wait_until

WATCH = "batchline.producer._watch"
SAID = re.compile(
    r"^(\d+) requests? waiting for up to [0-9.]+ s on queue '([^']+)' at (\S+): no live "
    r"worker serves that queue \(none sent a heartbeat within 10 s\); start one for it, e\.g\. "
    r"(?:BATCHLINE_REDIS_URL=(\S+) )?BATCHLINE_QUEUE=(\S+) batchline worker "
    r"\(said again in ([0-9.]+) s while it lasts\)$"
)


class Said(logging.Handler):
    """The watch's warnings, as they come (each checked against ``SAID``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[re.Match[str]] = []
        self._changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        match = SAID.match(record.getMessage())
        assert match is not None, record.getMessage()
        with self._changed:
            self.lines.append(match)
            self._changed.notify_all()

    def wait_for(self, count: int, timeout_s: float = 30.0) -> list[re.Match[str]]:
        """The first ``count`` warnings, once they are there (fails after ``timeout_s``)."""
        with self._changed:
            if not self._changed.wait_for(lambda: len(self.lines) >= count, timeout_s):
                raise AssertionError(f"{len(self.lines)} warnings within {timeout_s} s")
            return self.lines[:count]


@pytest.fixture
def said() -> Iterator[Said]:
    handler = Said()
    logger = logging.getLogger(WATCH)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_the_blocking_infer_without_a_timeout_says_no_worker_serves_the_queue(
    redis_url: str,
    queue: str,
    start_worker: Callable[..., WorkerThread],
    said: Said,
) -> None:
    """The README's call, exactly: no timeout_s. It says so, again at doubling intervals,
    and is answered once a worker comes."""
    # The producer closes first, failing the infer that may still wait, if the test fails.
    with (
        ThreadPoolExecutor(1) as pool,
        Producer(redis_url=redis_url, queue=queue, no_worker_log_s=0.1) as producer,
    ):
        answer = pool.submit(producer.infer, "waits for a worker")
        lines = said.wait_for(3)
        first = lines[0]
        assert first.group(1) == "1"
        assert first.group(2) == queue
        assert first.group(3) == redis_url
        # The command starts a worker on this Redis (not the default localhost:6379).
        assert not redis_url.startswith("redis://localhost:6379/")
        assert first.group(4) == redis_url
        assert first.group(5) == queue
        # The gaps it announces double: 0.2, 0.4, 0.8 s.
        assert [float(m.group(6)) for m in lines] == [0.2, 0.4, 0.8]
        assert not answer.done()
        start_worker()
        assert answer.result(timeout=30) == "waits for a worker"


async def test_wait_and_stream_say_it_too(redis_url: str, queue: str, said: Said) -> None:
    async with AsyncProducer(redis_url=redis_url, queue=queue, no_worker_log_s=0.1) as producer:
        handle = await producer.submit("waits")
        waiting = asyncio.ensure_future(producer.wait(handle))
        await asyncio.to_thread(said.wait_for, 1)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await producer.cancel(handle)  # nothing waits here now: the watch starts afresh

        async def streamed() -> None:
            async for _chunk in producer.stream("nor this"):
                pass

        streaming = asyncio.ensure_future(streamed())
        await asyncio.to_thread(said.wait_for, 2)
        streaming.cancel()
        await asyncio.gather(streaming, return_exceptions=True)


async def test_the_command_names_the_redis_url_without_its_password(
    redis_url: str, queue: str, said: Said
) -> None:
    """Through a Redis user with a password: the log and a timeout's RequestTimeout both give
    the command with the URL, its password redacted; the password is in neither."""
    password = f"pw-{uuid.uuid4().hex}"
    user = f"nw-{uuid.uuid4().hex[:8]}"
    admin = redis.Redis.from_url(redis_url)
    admin.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys="*", channels="*", commands=["+@all"]
    )
    url = redis_url.replace("redis://", f"redis://{user}:{password}@", 1)
    shown = redis_url.replace("redis://", f"redis://{user}:***@", 1)
    try:
        async with AsyncProducer(redis_url=url, queue=queue, no_worker_log_s=0.1) as producer:
            waiting = asyncio.ensure_future(producer.infer("waits for a worker"))
            (line,) = await asyncio.to_thread(said.wait_for, 1)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            with pytest.raises(RequestTimeout) as caught:
                await producer.infer("nobody answers", timeout_s=0.2)
    finally:
        admin.acl_deluser(user)
        admin.close()
    command = f"BATCHLINE_REDIS_URL='{shown}' BATCHLINE_QUEUE={queue} batchline worker"
    assert command in str(caught.value), caught.value
    assert line.group(3) == shown
    assert line.group(4) == f"'{shown}'"
    for text in (str(caught.value), line.string):
        assert password not in text, text


def test_a_busy_worker_is_not_a_missing_one(
    redis_url: str,
    queue: str,
    start_worker: Callable[..., WorkerThread],
    said: Said,
) -> None:
    """A worker holding the request (live, busy) is not reported missing."""
    gate = GatedModel()
    start_worker(gate, batch_size=1)
    with Producer(redis_url=redis_url, queue=queue, no_worker_log_s=0.05) as producer:
        try:
            handle = producer.submit("held in the model")
            assert gate.entered.wait(30)
            calls = _zcounts_not_in_beats(redis_url)
            wait_until(lambda: _zcounts_not_in_beats(redis_url) > calls, "the watch to look")
        finally:
            gate.release.set()
        assert producer.result(handle, timeout_s=30) == "held in the model"
    assert said.lines == []


def _calls(redis_url: str, command: str) -> int:
    """How many times the server has run ``command`` (its commandstats)."""
    client = redis.Redis.from_url(redis_url)
    try:
        stats = client.info("commandstats").get(f"cmdstat_{command}", {})
    finally:
        client.close()
    return int(stats.get("calls", 0)) if isinstance(stats, dict) else 0


def _zcounts_not_in_beats(redis_url: str) -> int:
    """ZCOUNT calls the server has run, less the heartbeats' (each beat: one ZADD of the
    worker, one ZCOUNT): how the watch (and a timed-out request) counts live workers; no
    other command of the producer uses it."""
    return _calls(redis_url, "zcount") - _calls(redis_url, "zadd")


def _beats(redis_url: str, queue: str) -> bool:
    """Whether a worker of the queue has sent a heartbeat (its pipeline ran, ZCOUNT too)."""
    client = redis.Redis.from_url(redis_url)
    try:
        return bool(client.zcard(QueueKeys(queue).workers))
    finally:
        client.close()


async def test_requests_answered_in_time_cost_no_redis_command(
    redis_url: str, queue: str, start_worker: Callable[..., WorkerThread]
) -> None:
    # A worker's heartbeat counts the live workers too (ZCOUNT), with a ZADD: taken off.
    start_worker(heartbeat_s=5.0)
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        await producer.infer("warm-up", timeout_s=30)
        await asyncio.to_thread(wait_until, lambda: _beats(redis_url, queue), "its first beat")
        before = _zcounts_not_in_beats(redis_url)
        for _ in range(3):
            assert await producer.map(range(200), timeout_s=30) == list(range(200))
        assert _zcounts_not_in_beats(redis_url) == before
