"""Floods and oversized inputs against a real Redis and an in-process worker.

A producer flooding a bounded queue with no worker: the queue takes exactly its bound, every
other submit is refused at once (QueueFull, nothing stored), Redis memory stays bounded, and
a worker started afterwards answers every accepted request. Inputs past the worker's limits
get an error result of their own while a normal request read with them is answered.

The time bounds here are behaviour bounds (a refusal never waits for room), not benchmarks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis

from batchline.codec import Result
from batchline.errors import QueueFull
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer, Handle

from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerThread,
    pending_count,
    queued,
    stream_lengths,
    wait_until,
)

pytestmark = pytest.mark.slow  # 100,000 submits, and a worker's limits on large inputs

FLOOD = 100_000
DEPTH = 10_000
CHUNK = 1_000
REFUSALS_BOUND_S = 60.0  # all 90,000 refusals together, on a small shared machine
MEMORY_BOUND = 100 << 20  # Redis used_memory growth during the flood


def _used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


@pytest.mark.timeout(300)
async def test_a_flood_fills_the_queue_to_its_bound_and_refuses_the_rest_at_once(
    redis_url: str,
    queue: str,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    memory_before = _used_memory(rclient)
    accepted: dict[int, Handle] = {}
    refused = 0
    slowest_chunk_s = 0.0
    refusing_s = 0.0  # time spent in chunks that were refused entirely
    async with AsyncProducer(redis_url=redis_url, queue=queue, max_queue_depth=DEPTH) as producer:
        started = time.monotonic()
        for first in range(0, FLOOD, CHUNK):
            values = range(first, first + CHUNK)
            t0 = time.monotonic()
            outcomes = await asyncio.gather(
                *(producer.submit(v) for v in values), return_exceptions=True
            )
            took = time.monotonic() - t0
            slowest_chunk_s = max(slowest_chunk_s, took)
            chunk_refused = 0
            for v, outcome in zip(values, outcomes, strict=True):
                if isinstance(outcome, Handle):
                    accepted[v] = outcome
                elif isinstance(outcome, QueueFull):
                    chunk_refused += 1
                else:
                    raise AssertionError(f"submit({v}) gave {outcome!r}")
            refused += chunk_refused
            if chunk_refused == CHUNK:
                refusing_s += took
        flood_s = time.monotonic() - started
        memory_growth = _used_memory(rclient) - memory_before

        assert len(accepted) == DEPTH
        assert refused == FLOOD - DEPTH
        # Concurrent submits are checked in arrival order: the first DEPTH are the ones taken.
        assert sorted(accepted) == list(range(DEPTH))
        assert refusing_s < REFUSALS_BOUND_S, f"90k refusals took {refusing_s:.1f} s"
        assert queued(rclient, keys) == DEPTH
        assert await producer.queue_depth() == DEPTH
        assert memory_growth < MEMORY_BOUND, f"used_memory grew {memory_growth} bytes"
        print(
            f"\nflood: {FLOOD} submits in {flood_s:.1f} s; {refused} refusals in "
            f"{refusing_s:.1f} s; slowest chunk of {CHUNK} {slowest_chunk_s * 1e3:.0f} ms; "
            f"used_memory +{memory_growth / 2**20:.1f} MiB"
        )

        start_worker(batch_size=64)
        results: list[Result] = await asyncio.gather(
            *(producer.wait(h, timeout_s=RESULT_TIMEOUT_S) for h in accepted.values())
        )
        for v, result in zip(accepted, results, strict=True):
            assert (result.status, result.output) == ("ok", v), result
        assert max(r.batch_size for r in results) <= 64
        wait_until(lambda: sum(stream_lengths(rclient, keys)) == 0, "the streams to empty")
        assert pending_count(rclient, keys) == 0
        assert await producer.queue_depth() == 0


@pytest.mark.parametrize(
    ("oversized", "error_type", "words"),
    [
        ("x" * 1001, "MalformedRequest", "max_chars=1000"),
        (np.zeros(1001, dtype=np.float32), "MalformedRequest", "max_elements"),
        ({"ids": np.zeros((40, 40), dtype=np.int32)}, "MalformedRequest", "max_elements"),
    ],
    ids=["text-past-max_chars", "array-past-max_elements", "2d-array-past-max_elements"],
)
async def test_an_oversized_input_gets_an_error_result_and_the_rest_of_its_batch_runs(
    redis_url: str,
    queue: str,
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    oversized: Any,
    error_type: str,
    words: str,
) -> None:
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        # Submitted before the worker starts, so that one read takes them all.
        before = await producer.submit("fine before")
        bad = await producer.submit(oversized)
        at_limit_text = await producer.submit("y" * 1000)
        at_limit_array = await producer.submit(np.arange(1000, dtype=np.float32))
        after = await producer.submit("fine after")
        start_worker(batch_size=8, timeout_ms=50.0, max_chars=1000, max_elements=1000)

        result = await producer.wait(bad, timeout_s=RESULT_TIMEOUT_S)
        assert result.status == "error", result
        assert result.error_type == error_type, result
        assert words in result.error_message, result
        assert result.output is None

        assert await producer.result(before, timeout_s=RESULT_TIMEOUT_S) == "fine before"
        assert await producer.result(after, timeout_s=RESULT_TIMEOUT_S) == "fine after"
        assert await producer.result(at_limit_text, timeout_s=RESULT_TIMEOUT_S) == "y" * 1000
        got = await producer.result(at_limit_array, timeout_s=RESULT_TIMEOUT_S)
        np.testing.assert_array_equal(got, np.arange(1000, dtype=np.float32))
        wait_until(lambda: sum(stream_lengths(rclient, keys)) == 0, "the streams to empty")
        assert pending_count(rclient, keys) == 0
        # The refused entry is kept as a dead letter, with the reason.
        dead: Any = rclient.xrange(keys.dead)
        assert len(dead) == 1
        assert dead[0][1][b"reason"].decode().startswith(error_type)
