"""A worker and a producer ride out whatever the Redis client library raises from inside its
own code while Redis fails over, and a bug in batchline's own code still stops a worker.

redis-py's asyncio connection is made to fail as it did in the cluster failover test: its
writer gone under a command, ``AttributeError: 'NoneType' object has no attribute
'writelines'`` raised from redis/asyncio/connection.py (the real method, called on the
real connection with its writer taken away). Every loop of the worker (reader, admitter,
cancel reader, heartbeat, facts, cache, janitor, reclaimer, cancel trim, the writer) and the
producer's reply reader meets it; they back off, log and carry on, and the requests are
answered once Redis "comes back". A real Redis and a real worker (in this process, so that
the patch reaches it)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from redis.asyncio.connection import AbstractConnection

from batchline.errors import ServiceUnavailable
from batchline.keys import QueueKeys
from batchline.producer import Producer
from batchline.transport import _errors
from batchline.worker.shared._consumers import PRUNE

from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, wait_until

T = RESULT_TIMEOUT_S


def command_of(packed: Any) -> tuple[str, list[bytes]]:
    """The name and arguments of the first command in a packed (RESP) write."""
    raw = b"".join(packed) if isinstance(packed, list | tuple) else packed
    raw = raw.encode() if isinstance(raw, str) else bytes(raw)
    parts = raw.split(b"\r\n")
    count = int(parts[0][1:])
    words = [parts[2 + 2 * i] for i in range(count)]
    return words[0].decode().upper(), words[1:]


@dataclass
class Breakage:
    """Which commands the patched connections fail, and which loops have met a failure."""

    keys: QueueKeys
    failing: bool = False
    fail_next: dict[str, int] = field(default_factory=dict)  # loop -> how many more
    met: set[str] = field(default_factory=set)
    all_met: threading.Event = field(default_factory=threading.Event)
    expected: frozenset[str] = frozenset()
    lock: threading.Lock = field(default_factory=threading.Lock)

    def loop_of(self, name: str, args: list[bytes]) -> str:
        k = self.keys
        text = b" ".join(args).decode(errors="replace")
        if name == "XREAD":
            return "reply reader" if k.reply_prefix in text else "cancel reader"
        if name == "SET":
            return "facts" if k.facts in text else "cache" if k.model in text else "set"
        if name in ("EVALSHA", "EVAL"):  # the completion script, or the janitor's pruning one
            return "writer" if k.dead in text else "janitor"
        if name == "SCRIPT" and PRUNE.source in text:  # loaded on the janitor's first call
            return "janitor"
        return {
            "XREADGROUP": "reader",
            "FCALL": "admitter",
            "BLMOVE": "admitter",
            "ZADD": "heartbeat",
            "XPENDING": "reclaimer",
            "XTRIM": "cancel trim",
        }.get(name, name)

    def should_fail(self, packed: Any) -> bool:
        loop = self.loop_of(*command_of(packed))
        with self.lock:
            if self.fail_next.get(loop, 0) > 0:
                self.fail_next[loop] -= 1
            elif not self.failing:
                return False
            self.met.add(loop)
            if self.expected <= self.met:
                self.all_met.set()
        return True


@pytest.fixture
def breakage(monkeypatch: pytest.MonkeyPatch, keys: QueueKeys) -> Iterator[Breakage]:
    state = Breakage(keys)
    send = AbstractConnection.send_packed_command
    # Each place in redis-py is logged with its traceback once per process: once per test here.
    monkeypatch.setattr(_errors, "_LIBRARY_PLACES", set())

    async def flaky(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        if state.should_fail(command):
            writer, self._writer = self._writer, None
            try:  # redis-py's own write, on a connection whose writer is gone
                await AbstractConnection._send_packed_command(self, command)  # type: ignore[arg-type]
            finally:
                self._writer = writer
        await send(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", flaky)
    yield state
    state.failing = False


LOOPS = frozenset(
    {
        "reader",
        "admitter",
        "cancel reader",
        "reply reader",
        "heartbeat",
        "facts",
        "cache",
        "janitor",
        "reclaimer",
        "cancel trim",
    }
)


def test_every_loop_rides_out_the_client_librarys_own_failures(
    breakage: Breakage,
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Short periods, so that every periodic loop calls Redis within a fraction of a second.
    thread = start_worker(claim_idle_ms=600, cache_ttl_s=60, heartbeat_s=0.1)
    with caplog.at_level(logging.WARNING), Producer(redis_url=redis_url, queue=queue) as producer:
        assert producer.infer(1, timeout_s=T) == 1
        breakage.expected = LOOPS
        breakage.failing = True
        met = breakage.all_met.wait(T)
        breakage.failing = False
        assert met, f"loops that met no failure: {sorted(LOOPS - breakage.met)}"
        assert thread.alive
        # Redis answers again: the worker serves, the producer reads its replies.
        assert producer.map([2, 3, 4], timeout_s=T) == [2, 3, 4]
        # The writer's completion fails twice, and is written the third time.
        breakage.fail_next["writer"] = 2
        assert producer.infer(5, timeout_s=T) == 5
        assert breakage.fail_next["writer"] == 0
    assert thread.alive
    assert thread.error is None
    assert "writelines" in caplog.text
    assert "from inside its own code" in caplog.text  # with the library's traceback
    assert "a task failed" not in caplog.text


def test_a_bug_in_batchlines_own_code_stops_the_worker_loudly(
    start_worker: Callable[..., WorkerThread], caplog: pytest.LogCaptureFixture
) -> None:
    thread = start_worker(heartbeat_s=0.1)
    heartbeat = thread.worker._parts.upkeep.heartbeat
    with caplog.at_level(logging.ERROR):
        heartbeat._stats = lambda: {"not json": object()}  # json.dumps fails in beat()
        wait_until(lambda: not thread.alive, "the worker to stop by itself")
    error, thread.error = thread.error, None  # seen here, not raised again by its fixture
    assert isinstance(error, RuntimeError), error
    assert "stopped: a task failed" in str(error)
    assert isinstance(error.__cause__, TypeError)
    assert "batchline-heartbeat failed" in caplog.text


def test_a_bug_in_the_answer_writer_stops_the_worker_and_its_request_is_answered_later(
    start_worker: Callable[..., WorkerThread],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    redis_url: str,
    queue: str,
) -> None:
    """A write of answers that fails with an error of the writer's own (not Redis's) stops
    the worker loudly, as any of its tasks' would; the request it could not answer is left
    pending, and a fresh worker answers it."""
    from batchline.worker.serving import _writer

    record = _writer.AnswerWriter._record

    def broken(self: Any, r: Any) -> Any:
        if r.request_id == "boom":
            raise TypeError("a bug in the writer")
        return record(self, r)

    monkeypatch.setattr(_writer.AnswerWriter, "_record", broken)
    thread = start_worker(claim_idle_ms=500)
    with Producer(redis_url=redis_url, queue=queue) as producer, caplog.at_level(logging.ERROR):
        handle = producer.submit("x", request_id="boom")
        wait_until(lambda: not thread.alive, "the worker to stop by itself")
        error, thread.error = thread.error, None  # seen here, not raised again by its fixture
        assert isinstance(error, RuntimeError), error
        assert isinstance(error.__cause__, TypeError)
        assert "batchline-writer failed" in caplog.text
        monkeypatch.setattr(_writer.AnswerWriter, "_record", record)
        start_worker(claim_idle_ms=500)
        assert producer.wait(handle, 60).unwrap() == "x"


def test_a_producer_reports_the_librarys_failure_as_a_typed_error(
    breakage: Breakage, redis_url: str, queue: str
) -> None:
    with Producer(redis_url=redis_url, queue=queue) as producer:
        breakage.failing = True
        for call in (producer.queue_depth, lambda: producer.get_result("r1")):
            with pytest.raises(ServiceUnavailable, match="writelines") as caught:
                call()
            assert isinstance(caught.value.__cause__, AttributeError)
        breakage.failing = False
        assert producer.queue_depth() == 0
