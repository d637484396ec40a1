"""What the runs of a batch driver share (:class:`RunContext`), how batches run
(:class:`DriverOptions`), the error of a run whose replica lost the batch's lease, and which
of a batch's lines another live batch waits on too (:func:`waiting_elsewhere`)."""

from __future__ import annotations

from dataclasses import dataclass

from batchline.contrib.batches._files import FileStore
from batchline.contrib.openai import OpenAIRoutes
from batchline.errors import BatchlineError
from batchline.keys import BatchApiKeys
from batchline.transport import RedisClient

__all__ = ["DriverOptions", "LeaseLost", "RunContext", "waiting_elsewhere"]


@dataclass(frozen=True, slots=True)
class DriverOptions:
    """How batches run.

    Attributes:
        priority: the queue priority of a batch's requests.
        window: most inputs of one batch under way at once (:mod:`._output`).
        lease_s: how long a replica's hold on a batch lasts without renewal.
        max_answer_bytes: the largest answer of one line.
        max_output_bytes: the most bytes of one batch's output and error files together.
        output_ratio: the same, as a multiple of the input file's bytes.
    """

    priority: int = 0
    window: int = 256
    lease_s: float = 10.0
    max_answer_bytes: int = 32 << 20
    max_output_bytes: int = 1 << 30
    output_ratio: float = 1000.0


@dataclass(frozen=True, slots=True)
class RunContext:
    """What every run of one replica shares: Redis, the files, the OpenAI routes (their
    producers and request models), the options, and the replica's lease owner name."""

    redis: RedisClient
    keys: BatchApiKeys
    files: FileStore
    routes: OpenAIRoutes
    options: DriverOptions
    owner: str


class LeaseLost(BatchlineError):
    """This replica holds a batch's lease no more: another one drives it."""


async def waiting_elsewhere(
    context: RunContext, batch_id: str, fields: dict[str, str], indexes: list[int]
) -> set[int]:
    """The lines of ``indexes`` (of the batch ``batch_id``, whose hash is ``fields``) that
    another live batch over the same file (the same endpoint and tenant: the same request
    ids) has not answered yet: it waits, or will wait, on their requests."""
    redis, keys = context.redis, context.keys
    mine = [fields["input_file_id"], fields["endpoint"], fields.get("tenant", "")]
    shared: set[int] = set()
    for raw in await redis.smembers(keys.active):
        other = raw.decode()
        if other == batch_id:
            continue
        found = await redis.hgetall(keys.batch(other))
        theirs = [
            found.get(name.encode(), b"").decode()
            for name in ("input_file_id", "endpoint", "tenant", "status")
        ]
        if theirs[:3] != mine or theirs[3] not in ("validating", "in_progress"):
            continue
        answered = await redis.smismember(keys.answered(other), indexes)
        shared.update(i for i, was in zip(indexes, answered, strict=True) if not was)
    return shared
