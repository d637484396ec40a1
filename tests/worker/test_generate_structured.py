"""Structured output over Redis: a ``--model generate`` worker serving a tiny random Llama
with a fast tokenizer (models_for_tests.tiny_llama_chars). A request whose schema cannot be
compiled, or whose grammar fails as it decodes, fails alone with ``BadGenerationParams``
(a 400-class error for the API), and the requests beside it are answered exactly as they
would be without it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from batchline.keys import QueueKeys
from batchline.producer import Producer

from tests.e2e.test_reliability import assert_all_done
from tests.support.models_for_tests import tiny_llama_chars
from tests.support.schemas import GOOD, HUGE_PATTERN, LAZY, json_schema
from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, spec

pytest.importorskip("torch")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

T = RESULT_TIMEOUT_S


GOOD_FORMAT = json_schema(GOOD)
INNOCENT: list[dict[str, Any]] = [
    {"prompt": "Once upon a time", "max_new_tokens": 16},
    {"prompt": "abc", "max_new_tokens": 12, "temperature": 0.8, "seed": 3},
    {"prompt": "{", "max_new_tokens": 40, "response_format": GOOD_FORMAT},
    {
        "prompt": "x",
        "max_new_tokens": 40,
        "response_format": GOOD_FORMAT,
        "temperature": 1.0,
        "seed": 1,
    },
]
BAD: list[dict[str, Any]] = [
    {"prompt": "x", "max_new_tokens": 20, "response_format": json_schema(HUGE_PATTERN)},  # probe
    {"prompt": "x", "max_new_tokens": 20, "response_format": json_schema(LAZY)},  # as it decodes
]


@pytest.fixture(scope="module")
def reference() -> Iterator[Any]:
    """The in-process generator on the same model, one request at a time."""
    from batchline.generation import SyncGenerator

    model, tok = tiny_llama_chars()
    with SyncGenerator(model, tokenizer=tok, max_batch_size=1) as gen:
        yield gen


@pytest.mark.slow
def test_a_bad_response_format_fails_only_its_own_request(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    reference: Any,
) -> None:
    start_worker("generate", model_path=spec("tiny_llama_chars"), batch_size=8)
    values = [INNOCENT[0], BAD[0], INNOCENT[1], BAD[1], INNOCENT[2], INNOCENT[3]]
    with Producer(redis_url=redis_url, queue=queue) as producer:
        handles = [producer.submit(v) for v in values]
        results = [producer.wait(h, timeout_s=T) for h in handles]
        # The same schemas again: refused as clearly, never an empty "eos".
        again = [producer.wait(producer.submit(v), timeout_s=T) for v in BAD]
    for value, r in zip([*values, *BAD], [*results, *again], strict=True):
        if value in BAD:
            assert (r.status, r.error_type) == ("error", "BadGenerationParams"), r
            assert "response_format" in r.error_message
            assert "<" not in r.error_message  # no parser state or grammar dump
            continue
        assert r.status == "ok", (value, r)
        options = dict(value)
        want = reference.generate(options.pop("prompt"), **options)
        assert r.output["token_ids"] == list(want.token_ids), value
        assert r.output["text"] == want.text
        if "response_format" in value:
            jsonschema.validate(json.loads(r.output["text"]), GOOD)
    assert max(r.batch_size for r in results if r.status == "ok") > 1  # they shared steps
    assert rclient.xlen(keys.dead) == 0  # refused, not dead-lettered
    assert_all_done(rclient, keys)
