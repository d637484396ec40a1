"""The in-process API: asyncio Generator and thread SyncGenerator over tiny models."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import Any

import pytest

from batchline.errors import BadGenerationParams, BatcherClosed, PromptTooLong
from batchline.generation import GenerationResult, Generator, SyncGenerator

from tests.support.tiny import CharTokenizer, alone, tiny_model, torch

PROMPTS = [[5, 6, 7], [8] * 12, [9, 10], [11] * 30, [12, 13, 14, 15]]


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("llama")


@pytest.mark.slow
async def test_concurrent_generate_equals_each_alone(model: Any) -> None:
    async with Generator(model, max_batch_size=3) as gen:
        results = await asyncio.gather(
            *(gen.generate(prompt_ids=p, max_new_tokens=5 + i) for i, p in enumerate(PROMPTS))
        )
        assert gen.mean_batch > 1
    for i, (prompt, result) in enumerate(zip(PROMPTS, results, strict=True)):
        assert list(result.token_ids) == alone(model, prompt, 5 + i)
        assert result.finish_reason in ("length", "eos")
        assert 0 <= result.queue_s <= result.ttft_s <= result.total_s


@pytest.mark.slow
async def test_prompts_longer_than_max_prefill_tokens_give_the_same_tokens(
    model: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, "batchline.generation._model"):
        gen = Generator(model, max_prefill_tokens=4, max_batch_tokens=1000)
    async with gen:
        assert gen.engine.max_prefill_tokens == 4
        results = await asyncio.gather(
            *(gen.generate(prompt_ids=p, max_new_tokens=6) for p in PROMPTS)
        )
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert list(result.token_ids) == alone(model, prompt, 6)
    assert "KV budget: max_batch_tokens 1000 = 0.5 MiB of KV cache at most" in caplog.text


async def test_stream_yields_every_token_in_order(model: Any) -> None:
    async with Generator(model) as gen:
        tokens = [
            t async for d in gen.stream(prompt_ids=[5, 6], max_new_tokens=7) for t in d.token_ids
        ]
    assert tokens == alone(model, [5, 6], 7)


async def test_a_stream_ends_with_the_text_held_back_its_finish_reason_and_result(
    model: Any,
) -> None:
    """A stop string holds back the text that could start it while the request runs; a
    deadline ends it there. The stream's last delta gives that text, the finish reason and
    the result: the deltas joined equal the result's text (asyncio and threads alike). The
    clock ticks 10 ms a look, so the deadline comes after the same steps each time."""
    options: Any = {"prompt_ids": [5, 6], "max_new_tokens": 100, "timeout_s": 0.5}
    options["stop"] = ["0123456789"]  # never in the text (letters only): 9 characters held
    ticks = itertools.count()
    clock = lambda: next(ticks) * 0.01  # noqa: E731
    async with Generator(model, tokenizer=CharTokenizer(), clock=clock) as gen:
        deltas = [d async for d in gen.stream(**options)]
    with SyncGenerator(model, tokenizer=CharTokenizer(), clock=clock) as sync_gen:
        sync_deltas = list(sync_gen.stream(**options))
    for got in (deltas, sync_deltas):
        *steps, last = got
        assert all(d.finish_reason is None and d.result is None for d in steps)
        assert last.finish_reason == "deadline"
        assert last.result is not None
        assert last.token_ids == ()
        assert len(last.text) == 9  # held back
        assert "".join(d.text for d in got) == last.result.text
        assert [t for d in steps for t in d.token_ids] == list(last.result.token_ids)


async def test_typed_errors_for_one_request_alone(model: Any) -> None:
    async with Generator(model, max_batch_tokens=64) as gen:
        with pytest.raises(BadGenerationParams, match="top_p"):
            await gen.generate(prompt_ids=[5], top_p=0)
        with pytest.raises(BadGenerationParams, match="max_new_tokens"):
            await gen.generate(prompt_ids=[5], max_new_tokens=0)
        with pytest.raises(PromptTooLong, match="max_batch_tokens 64"):
            await gen.generate(prompt_ids=[5] * 60, max_new_tokens=10)
        with pytest.raises(PromptTooLong, match="context"):
            await gen.generate(prompt_ids=[5] * 200)
        result = await gen.generate(prompt_ids=[5], max_new_tokens=3)
        assert result.tokens == 3
    with pytest.raises(BatcherClosed):
        await gen.generate(prompt_ids=[5])


async def test_cancelling_the_caller_ends_its_sequence(model: Any) -> None:
    async with Generator(model) as gen:
        task = asyncio.create_task(gen.generate(prompt_ids=[5, 6], max_new_tokens=100_000 // 1000))
        async for _ in gen.stream(prompt_ids=[7], max_new_tokens=2):
            pass
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ok = await gen.generate(prompt_ids=[8], max_new_tokens=2)
        assert ok.tokens == 2


async def test_aclose_drains_what_is_in(model: Any) -> None:
    gen = Generator(model)
    pending = [asyncio.create_task(gen.generate(prompt_ids=p, max_new_tokens=4)) for p in PROMPTS]
    await asyncio.sleep(0)
    await gen.aclose()
    results = await asyncio.gather(*pending)
    assert all(isinstance(r, GenerationResult) and r.tokens for r in results)


@pytest.mark.slow
def test_sync_generator_from_threads(model: Any) -> None:
    out: dict[int, list[int]] = {}
    with SyncGenerator(model) as gen:

        def call(i: int) -> None:
            out[i] = list(gen.generate(prompt_ids=PROMPTS[i], max_new_tokens=6).token_ids)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        streamed = [t for d in gen.stream(prompt_ids=[5, 6], max_new_tokens=3) for t in d.token_ids]
    assert out == {i: alone(model, p, 6) for i, p in enumerate(PROMPTS)}
    assert streamed == alone(model, [5, 6], 3)


def test_device_and_dtype_place_a_loaded_model_only_where_named() -> None:
    kept = tiny_model("llama", torch.float64)
    with SyncGenerator(kept) as gen:  # auto: where and as it is
        assert gen.engine.model.dtype == torch.float64
    cast = tiny_model("llama", torch.float64)
    with SyncGenerator(cast, device="cpu", dtype="bfloat16") as gen:
        assert gen.engine.model.dtype == torch.bfloat16
        result = gen.generate(prompt_ids=[5, 6, 7], max_new_tokens=5)
    assert list(result.token_ids) == alone(cast, [5, 6, 7], 5)  # cast in place: bfloat16


def test_a_callers_event_loop_that_closed_leaves_the_model_thread_serving() -> None:
    """A caller leaves a stream and its event loop closes (``asyncio.run`` returns) while
    the model thread is still in a step: that step's events for it are dropped, and the
    model thread serves the next caller, on another loop."""
    slowed = tiny_model("llama")
    slowed.register_forward_pre_hook(lambda _module, _args: time.sleep(0.05))
    gen = Generator(slowed)

    async def leave() -> None:
        async for _ in gen.stream(prompt_ids=[5, 6], max_new_tokens=1000):
            break  # its loop closes as asyncio.run returns, mid-step

    async def next_caller() -> int:
        result = await asyncio.wait_for(gen.generate(prompt_ids=[7], max_new_tokens=3), 60)
        return result.tokens

    asyncio.run(leave())
    assert asyncio.run(next_caller()) == 3
    asyncio.run(gen.aclose())
