"""The heartbeat: a worker's place in the workers' set (docs/workers.md, Models loaded by
demand), which ``--check`` and the producers' no-worker watch read."""

from __future__ import annotations

from collections.abc import Iterator

import redis
from redis.asyncio import Redis as AsyncRedis

from batchline.core.stats import BatchStats
from batchline.keys import QueueKeys
from batchline.transport import as_client
from batchline.worker.metrics import Metrics
from batchline.worker.upkeep._upkeep import Heartbeat


class _Stats:
    stats = BatchStats()


async def test_a_worker_turned_unhealthy_during_a_beat_is_not_left_among_the_live(
    redis_url: str, queue: str, rclient: redis.Redis
) -> None:
    """The beat decides to add the worker, then its model fails to load and the worker
    signs off while the beat is under way: the beat's ZADD may land after the sign-off's
    ZREM. The beat looks again once it has landed, and takes the worker out."""
    keys = QueueKeys(queue)
    answers: Iterator[bool] = iter([True, False, False])  # live as the beat starts; not after
    seen: list[int] = []
    client = AsyncRedis.from_url(redis_url)
    try:
        beat = Heartbeat(
            as_client(client),
            keys,
            "w-1",
            period_s=1.0,
            stats=dict,
            batcher=_Stats(),  # type: ignore[arg-type]
            metrics=Metrics(0),
            on_live=seen.append,
            live=lambda: next(answers),
        )
        await beat.beat()
    finally:
        await client.aclose()
    assert rclient.zscore(keys.workers, "w-1") is None
    assert seen == [0], "the live count leaves it out too"
