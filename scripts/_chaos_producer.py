"""chaos.py's producer processes: a steady load with known answers, every reply counted.

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
from pathlib import Path
from typing import Any

import redis

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
    asyncio.run(_produce(idx, url, queue, rate, end_at, drain_s, Path(out), poison_every))


def _value(idx: int, i: int, poison_every: tuple[int, int]) -> Any:
    """The i-th value of producer idx: a number, or a poison input every N-th request."""
    for kind, every in zip(POISON, poison_every, strict=True):
        if every and i % every == every - 1:
            return kind
    return idx * 1_000_000_000 + i


async def _produce(
    idx: int,
    url: str,
    queue: str,
    rate: float,
    end_at: float,
    drain_s: float,
    out: Path,
    poison_every: tuple[int, int] = (0, 0),
) -> None:
    from batchline.producer import AsyncProducer

    accepted: dict[str, list[Any]] = {}  # rid -> [value, accepted at (unix s)]
    submit_failed: dict[str, str] = {}  # rid -> exception type
    results: dict[str, list[Any]] = {}  # rid -> [status, output, etype, how]
    replies: Counter[str] = Counter()  # raw replies seen by the reply readers
    first_reply_at: dict[str, float] = {}
    producers: list[Any] = []
    tasks: list[asyncio.Task[None]] = []
    restarts = 0

    async def new_producer() -> Any:
        producer = AsyncProducer(redis_url=url, queue=queue)
        # Count raw replies where they arrive: the public API settles each request once and
        # drops a second reply for it silently.
        deliver = producer._replies.deliver

        def counting(raw: dict[Any, Any]) -> None:
            rid: str = raw.get(b"id", b"?").decode(errors="replace")
            replies[rid] += 1
            first_reply_at.setdefault(rid, time.time())
            deliver(raw)

        # A patched method: mypy refuses assigning to one (method-assign) and compares the
        # function with the unbound method, self included (assignment).
        producer._replies.deliver = counting  # type: ignore[method-assign, assignment]
        await producer.start()
        producers.append(producer)
        return producer

    async def waiter(producer: Any, handle: Any) -> None:
        try:
            r = await producer.wait(handle, timeout_s=max(1.0, end_at + drain_s - time.time()))
            results[handle.id] = [r.status, r.output, r.error_type, "reply"]
        except Exception as exc:  # RequestTimeout, BatcherClosed: decided at the end
            _ = exc

    producer = await new_producer()
    consecutive_failures = 0
    period = 1.0 / rate
    next_at = time.monotonic()
    i = 0
    while time.time() < end_at:
        value = _value(idx, i, poison_every)
        rid = f"p{idx}-{i}"
        i += 1
        try:
            async with asyncio.timeout(5.0):
                handle = await producer.submit(value, request_id=rid)
        except Exception as exc:  # Redis down: ConnectionError, BusyLoadingError, timeout
            submit_failed[rid] = type(exc).__name__
            consecutive_failures += 1
            if consecutive_failures >= 5:
                # Keep the old producer open: its reader reconnects and still settles what it
                # accepted. New requests go through a fresh producer (new connection pool and
                # reply stream), as an application restarting its client would do.
                producer = await new_producer()
                restarts += 1
                consecutive_failures = 0
            await asyncio.sleep(0.1)
            next_at = time.monotonic()
            continue
        consecutive_failures = 0
        accepted[rid] = [value, time.time()]
        tasks.append(asyncio.create_task(waiter(producer, handle)))
        next_at += period
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    if tasks:
        await asyncio.wait(tasks, timeout=max(1.0, end_at + drain_s - time.time() + 5))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # What no reply settled (e.g. sent to a producer whose reader had gone): the result key.
    client = redis.Redis.from_url(url)
    keys = QueueKeys(queue)
    try:
        for rid in accepted:
            if rid in results:
                continue
            with contextlib.suppress(redis.RedisError, OSError):
                raw = client.get(keys.result(rid))
                if raw is not None:
                    from batchline.codec import Limits, unpack_result

                    r = unpack_result(raw, Limits())
                    results[rid] = [r.status, r.output, r.error_type, "result-key"]
    finally:
        client.close()
    for p in producers:
        with contextlib.suppress(Exception):
            await p.aclose()
    out.write_text(  # noqa: ASYNC240 - once, at the very end
        json.dumps(
            {
                "accepted": accepted,
                "submit_failed": submit_failed,
                "results": results,
                "replies": dict(replies),
                "first_reply_at": first_reply_at,
                "restarts": restarts,
            }
        )
    )
