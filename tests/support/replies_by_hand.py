"""Reply entries pushed by hand onto a producer's reply stream, as the completion script
would push them (the protocol in docs/protocol.md), and the producer fixture and bounded
async wait that test_replies.py and test_infer.py share."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import pytest
import redis

from batchline.codec import SCHEMA_VERSION, Result, pack_value
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer

from .service import RESULT_TIMEOUT_S

T = RESULT_TIMEOUT_S


@pytest.fixture
async def producer(redis_url: str, queue: str) -> AsyncIterator[AsyncProducer]:
    """A producer that adds its entries to the work streams itself (the script's mode): the
    tests that use it play the worker by hand, reading those streams."""
    async with AsyncProducer(redis_url=redis_url, queue=queue, admission="scripts") as p:
        yield p


def flat(result: Result, **changed: Any) -> list[Any]:
    """One result as a reply entry carries it (docs/protocol.md): a flat [field, value, ...]
    list; ``changed`` replaces field values (to make it malformed)."""
    meta, blob = pack_value(result.output) if result.status == "ok" else (b"null", b"")
    fields: dict[str, Any] = {
        "v": str(SCHEMA_VERSION),
        "id": result.id,
        "status": result.status,
        "meta": meta,
        "blob": blob,
        "etype": result.error_type,
        "emsg": result.error_message,
        "queue_ms": f"{result.queue_ms:.3f}",
        "batch": str(result.batch_size),
        "model_ms": f"{result.model_ms:.3f}",
        "worker": result.worker,
    }
    fields.update(changed)
    return [x for kv in fields.items() for x in kv]


def push_reply(client: redis.Redis, keys: QueueKeys, producer_id: str, results: list[Any]) -> None:
    """Add one reply entry by hand, as the completion script does (``results``: flat lists,
    or anything else a test wants the reader to face)."""
    packed = msgpack.packb(results, use_bin_type=False)
    client.xadd(keys.reply(producer_id), {"n": len(results), "r": packed})


async def eventually(check: Callable[[], Any], what: str, *, timeout_s: float = T) -> Any:
    """Await until ``check()`` (a value or an awaitable) is truthy, without blocking the loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)
