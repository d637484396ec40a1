"""What a caller sees when nothing answers: a timeout that names its queue and says whether
any live worker serves it (the first thing to check); and a producer whose Redis is not
there says so naming the URL (its password redacted), once, then at most once per quiet
period with a count, not once per retry."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable

import pytest

import batchline.producer._replies
from batchline.errors import RequestTimeout
from batchline.producer import AsyncProducer

from tests.support.models_for_tests import GatedModel
from tests.support.service import WorkerThread, _redis_server_binary

NO_WORKER = "no live worker serves that queue (none sent a heartbeat within 10 s)"


async def test_a_timeout_without_a_worker_names_the_queue_and_says_none_serves_it(
    redis_url: str, queue: str
) -> None:
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        with pytest.raises(RequestTimeout) as infer:
            await producer.infer("nobody answers", timeout_s=0.2)
        handle = await producer.submit("nobody answers either")
        with pytest.raises(RequestTimeout) as wait:
            await producer.wait(handle, timeout_s=0.2)
        with pytest.raises(RequestTimeout) as stream:
            async for _chunk in producer.stream("nor this", timeout_s=0.2):
                pass
    for caught in (infer, wait, stream):
        message = str(caught.value)
        assert f"within 0.2 s on queue {queue!r}: {NO_WORKER}" in message, message
        command = f"BATCHLINE_REDIS_URL={redis_url} BATCHLINE_QUEUE={queue} batchline worker"
        assert command in message, message
    assert str(infer.value).startswith("no result for request ")
    assert str(stream.value).startswith("request ")


@pytest.mark.slow
async def test_a_timeout_with_a_busy_worker_says_which_serve_the_queue(
    redis_url: str, queue: str, start_worker: Callable[..., WorkerThread]
) -> None:
    gate = GatedModel()
    start_worker(gate, batch_size=1, heartbeat_s=0.2)
    try:
        async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
            with pytest.raises(RequestTimeout) as caught:
                await producer.infer("held in the model", timeout_s=0.5)
    finally:
        gate.release.set()
    message = str(caught.value)
    assert f"on queue {queue!r}, which 1 live worker serves: busy or slow" in message, message


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _until(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait on the event loop (the reader runs on it) until ``predicate`` holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_the_reply_reader_without_redis_names_the_url_and_keeps_quiet(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batchline.producer._replies, "_QUIET_S", 1.0)  # 10 s in production
    caplog.set_level(logging.WARNING, logger="batchline.producer._replies")
    port = _free_port()
    url = f"redis://:s3cret-pw@127.0.0.1:{port}/0"
    shown = f"reply reader (Redis at redis://:***@127.0.0.1:{port}/0)"

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "batchline.producer._replies"]

    binary = _redis_server_binary()
    server = None
    try:
        async with AsyncProducer(redis_url=url, queue="q"):
            # Retries at 0, 0.05, 0.15, 0.35, 0.75, 1.55, 3.15 s (the back-off): a line at
            # once, the next one past the quiet second, with the tries between counted.
            await _until(lambda: len(lines()) >= 2, "a second line")
            first, second = lines()[:2]
            assert first == f"{shown}: ConnectionError; retrying in 0.05 s", first
            assert second.startswith(f"{shown}: ConnectionError; retrying in "), second
            assert second.endswith(" more failed tries since the last line)"), second
            await asyncio.sleep(0.3)
            assert len(lines()) == 2, lines()  # quiet between
            if binary is None:
                return
            # Redis comes up: the reader reads again, and says so once.
            server = await asyncio.create_subprocess_exec(
                *(binary, "--port", str(port), "--bind", "127.0.0.1", "--requirepass"),
                *("s3cret-pw", "--save", "", "--appendonly", "no"),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            await _until(lambda: "works again" in lines()[-1], "the reader to read again")
            assert lines()[-1].startswith(f"{shown}: works again, after "), lines()
    finally:
        if server is not None:
            server.terminate()
            await server.wait()
    assert all("s3cret-pw" not in line for line in lines()), lines()
