"""The chaos check's producer processes: a steady load with known answers, every reply counted.

Each runs in a process of its own (``producer_main``, spawned), submits ``rate`` requests a
second until ``end_at`` (a poison input every N-th with ``poison_every``), waits for what is
outstanding, reads the result key of what no reply settled, and writes what it saw as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

if TYPE_CHECKING:
    from batchline.codec import Result

from batchline.keys import QueueKeys

POISON = ("crash", "hang")


def producer_main(
    idx: int,
    url: str,
    queue: str,
    rate: float,
    end_at: float,
    drain_s: float,
    out: str,
    poison_every: tuple[int, int],
) -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)
    load = _Load(idx, url, queue, end_at, drain_s)
    asyncio.run(_produce(load, rate, Path(out), poison_every))


def _value(idx: int, i: int, poison_every: tuple[int, int]) -> Any:
    """The i-th value of producer idx: a number, or a poison input every N-th request."""
    for kind, every in zip(POISON, poison_every, strict=True):
        if every and i % every == every - 1:
            return kind
    return idx * 1_000_000_000 + i


@dataclass
class _Load:
    """One producer process's load and what it saw of it, written as its report."""

    idx: int
    url: str
    queue: str
    end_at: float
    drain_s: float
    accepted: dict[str, list[Any]] = field(default_factory=dict)  # rid -> [value, at (unix s)]
    submit_failed: dict[str, str] = field(default_factory=dict)  # rid -> exception type
    # rid -> [status, output, etype, how]
    results: dict[str, list[Any]] = field(default_factory=dict)
    replies: Counter[str] = field(default_factory=Counter)  # replies seen by the readers
    first_reply_at: dict[str, float] = field(default_factory=dict)
    producers: list[Any] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    restarts: int = 0

    async def new_producer(self) -> Any:
        from batchline.producer import AsyncProducer

        producer = AsyncProducer(redis_url=self.url, queue=self.queue)
        # Count decoded replies where they arrive: the public API settles each request once and
        # drops a second reply for it silently.
        deliver = producer._replies.deliver

        def counting(result: Result) -> None:
            self.replies[result.id] += 1
            self.first_reply_at.setdefault(result.id, time.time())
            deliver(result)

        producer._replies.deliver = counting  # type: ignore[method-assign]
        await producer.start()
        self.producers.append(producer)
        return producer

    async def waiter(self, producer: Any, handle: Any) -> None:
        try:
            timeout_s = max(1.0, self.end_at + self.drain_s - time.time())
            r = await producer.wait(handle, timeout_s=timeout_s)
            self.results[handle.id] = [r.status, r.output, r.error_type, "reply"]
        except Exception as exc:  # RequestTimeout, BatcherClosed: decided at the end
            _ = exc

    async def submit_until_end(self, rate: float, poison_every: tuple[int, int]) -> None:
        """Submit ``rate`` requests a second until ``end_at``, a waiter task for each."""
        producer = await self.new_producer()
        consecutive_failures = 0
        period = 1.0 / rate
        next_at = time.monotonic()
        i = 0
        while time.time() < self.end_at:
            value = _value(self.idx, i, poison_every)
            rid = f"p{self.idx}-{i}"
            i += 1
            try:
                async with asyncio.timeout(5.0):
                    handle = await producer.submit(value, request_id=rid)
            except Exception as exc:  # Redis down: ConnectionError, BusyLoadingError, timeout
                self.submit_failed[rid] = type(exc).__name__
                consecutive_failures += 1
                if consecutive_failures >= 5:
                    # Keep the old producer open: its reader reconnects and still settles what
                    # it accepted. New requests go through a fresh producer (new connection
                    # pool and reply stream), as an application restarting its client would do.
                    producer = await self.new_producer()
                    self.restarts += 1
                    consecutive_failures = 0
                await asyncio.sleep(0.1)
                next_at = time.monotonic()
                continue
            consecutive_failures = 0
            self.accepted[rid] = [value, time.time()]
            self.tasks.append(asyncio.create_task(self.waiter(producer, handle)))
            next_at += period
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def drain(self) -> None:
        """Wait (at most until ``end_at + drain_s``, and 5 s) for the replies outstanding."""
        if self.tasks:
            timeout = max(1.0, self.end_at + self.drain_s - time.time() + 5)
            await asyncio.wait(self.tasks, timeout=timeout)
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def read_result_keys(self) -> None:
        """What no reply settled (e.g. sent to a producer whose reader had gone): its result key."""
        from batchline.codec import Limits, unpack_result

        client = redis.Redis.from_url(self.url)
        keys = QueueKeys(self.queue)
        try:
            for rid in self.accepted:
                if rid in self.results:
                    continue
                with contextlib.suppress(redis.RedisError, OSError):
                    raw = client.get(keys.result(rid))
                    if raw is not None:
                        r = unpack_result(raw, Limits())
                        self.results[rid] = [r.status, r.output, r.error_type, "result-key"]
        finally:
            client.close()

    async def close(self) -> None:
        for p in self.producers:
            with contextlib.suppress(Exception):
                await p.aclose()

    def report(self) -> str:
        return json.dumps(
            {
                "accepted": self.accepted,
                "submit_failed": self.submit_failed,
                "results": self.results,
                "replies": dict(self.replies),
                "first_reply_at": self.first_reply_at,
                "restarts": self.restarts,
            }
        )


async def _produce(
    load: _Load, rate: float, out: Path, poison_every: tuple[int, int] = (0, 0)
) -> None:
    """Submit, wait for the replies, read the result keys of the rest, write the report."""
    await load.submit_until_end(rate, poison_every)
    await load.drain()
    load.read_result_keys()
    await load.close()
    out.write_text(load.report())  # noqa: ASYNC240 - once, at the very end
