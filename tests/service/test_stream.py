"""Streaming a generation over Redis: chunks pushed as tokens come, ``AsyncProducer.stream``
and ``Producer.stream``, cancel on leaving, re-runs deduplicated by token index, bounds.

Real Redis, real workers (in this process where the test holds the model's steps with the
gate, as processes where one is killed), the tiny random Llama of test_generate.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis

from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer, StreamChunk

from .conftest import RESULT_TIMEOUT_S, WorkerThread, spec
from .test_reliability import assert_all_done

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


async def test_deltas_add_up_to_the_result_and_equal_infer(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    import asyncio

    start_worker("generate", model_path=TINY, batch_size=3)
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        streams = await asyncio.gather(*(collect(producer, v) for v in VALUES))
        answers = await asyncio.gather(*(producer.infer(v, timeout_s=T) for v in VALUES))
    for value, chunks, answer in zip(VALUES, streams, answers, strict=True):
        result = check_whole(chunks)
        assert result["token_ids"] == answer["token_ids"], value
        assert (result["text"], result["finish_reason"]) == (
            answer["text"],
            answer["finish_reason"],
        )
        if result["tokens"] > 2:  # streamed: more than the last chunk
            assert len(chunks) > 1, value
    assert streams[3][-1].finish_reason == "stop"
    assert_all_done(rclient, keys)
