"""What values a producer sends, through a real worker: dict keys that start with ``$`` (a
JSON schema's ``$defs`` and ``$ref``) arrive as they were given, and a value nested deeper
than ``MAX_JSON_DEPTH`` is refused before anything is sent, with a typed ``ValueError``
naming the limit (docs/protocol.md, Values); a result over ``max_result_bytes`` fails its
caller alone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis

from batchline import NestingTooDeep
from batchline.codec import MAX_JSON_DEPTH, DecodeError
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer, Producer

from tests.support.schemas import DEFS_SCHEMAS, SEED, json_schema_format
from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, assert_same, queued, spec

T = RESULT_TIMEOUT_S


def nested(levels: int) -> Any:
    value: Any = "innermost"
    for _ in range(levels):
        value = [value]
    return value


async def test_keys_that_start_with_a_dollar_arrive_as_given(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str
) -> None:
    start_worker()  # echo: answers each request with its value
    value = {
        "schema": DEFS_SCHEMAS["recursive"],
        "$nd": "a key of the value, not an array reference",
        "$": {"$$": [np.arange(3, dtype=np.int32), {"$ref": "#"}]},
        "deep": nested(MAX_JSON_DEPTH - 1),  # 64 levels with the dict around it: the limit
    }
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        assert_same(await producer.infer(value, timeout_s=T), value)


def test_a_value_nested_too_deep_is_refused_before_it_is_sent(
    redis_url: str, queue: str, rclient: redis.Redis, keys: QueueKeys
) -> None:
    looped: list[Any] = []
    looped.append(looped)  # a list inside itself: as deep as one can go
    with Producer(redis_url=redis_url, queue=queue) as producer:
        for value in (nested(MAX_JSON_DEPTH + 1), nested(50_000), {"x": looped}):
            with pytest.raises(NestingTooDeep) as refused:
                producer.submit(value)
            assert isinstance(refused.value, ValueError)
            assert refused.value.limit == MAX_JSON_DEPTH
            assert "MAX_JSON_DEPTH=64" in str(refused.value)
    assert queued(rclient, keys) == 0


@pytest.mark.slow
async def test_a_generation_request_with_defs_schemas_through_a_worker(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    start_worker("generate", model_path=spec("tiny_llama_chars"))
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        for name, schema in DEFS_SCHEMAS.items():
            request = {
                "prompt": "JSON:",
                "max_new_tokens": 200,
                "temperature": 1.0,
                "seed": SEED,
                "response_format": json_schema_format(name),
            }
            output = await producer.infer(request, timeout_s=T)
            assert output["finish_reason"] == "stop", (name, output)
            jsonschema.validate(json.loads(output["text"]), schema)


async def test_a_result_over_max_result_bytes_is_a_decode_error_for_its_caller_alone(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str
) -> None:
    """docs/service.md: a result larger than ``max_result_bytes`` is a DecodeError for its
    caller alone, not a wait until the timeout (or forever, without one); the next request's
    small result is taken."""
    start_worker()
    async with AsyncProducer(redis_url=redis_url, queue=queue, max_result_bytes=64) as producer:
        big, small = producer.infer("x" * 200), producer.infer("small")
        outcomes = await asyncio.wait_for(asyncio.gather(big, small, return_exceptions=True), T)
    assert isinstance(outcomes[0], DecodeError), outcomes[0]
    assert "refused by this producer's limits (max_result_bytes)" in str(outcomes[0])
    assert outcomes[1] == "small"
