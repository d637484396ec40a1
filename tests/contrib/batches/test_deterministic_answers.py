"""A worker in deterministic mode (``--deterministic``) gives a chat the same tokens and log
probabilities through every path: sent alone, inside a burst the worker batches, as a line
of a Batch API file, and in process; greedy and seeded, in bfloat16 with chunked prefill.

Off, 5 of 20 greedy SmolLM2 chats sent through the Batch API and directly differed on the
machine measured; the kernels that vary are tested in
tests/generation/test_deterministic_generation.py."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from batchline.generation import SyncGenerator

from ..openai.test_openai import client_for
from ..test_fastapi import Serve, serve
from .test_batches import MakeApp, file_lines, finished, jsonl, make_app, upload
from tests.support.models_for_tests import tiny_llama
from tests.support.service import WorkerThread
from tests.worker.test_generate import TINY

pytest.importorskip("torch")

__all__ = ["make_app", "serve"]  # fixtures, used here

WORDS = ["sea", "cat", "rust", "tea", "moon", "Paris", "bread", "jazz", "snow", "clock"]


def bodies(model: str) -> list[dict[str, Any]]:
    """20 greedy chats and 4 seeded ones, of mixed lengths."""
    out = []
    for i in range(24):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + (i * 7) % 23))
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": f"Tell me about {text}."}],
            "max_tokens": 8,
            "logprobs": True,
            "temperature": 0,
        }
        if i >= 20:
            body.update(temperature=0.9, seed=100 + i)
        out.append(body)
    return out


def answer(response: dict[str, Any]) -> tuple[str, list[float]]:
    choice = response["choices"][0]
    return choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]]


@pytest.mark.slow
def test_a_chat_gets_the_same_bits_alone_in_a_burst_and_through_the_batch_api(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    queue: str,
) -> None:
    gen_queue = f"{queue}-gen"
    start_worker(
        "generate",
        model_path=TINY,
        queue=gen_queue,
        prefix=queue,
        dtype="bfloat16",
        deterministic=True,
        max_prefill_tokens=16,
        timeout_ms=20,
    )
    client = client_for(serve(make_app(embedding_queue=None, generation_queue=gen_queue)))
    chats = bodies(gen_queue)

    def direct(body: dict[str, Any]) -> tuple[str, list[float]]:
        return answer(client.chat.completions.create(**body).model_dump())

    alone = [direct(body) for body in chats]
    with ThreadPoolExecutor(len(chats)) as pool:
        burst = list(pool.map(direct, chats))
    assert burst == alone
    lines = [
        {"custom_id": str(i), "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i, body in enumerate(chats)
    ]
    batch = client.batches.create(
        input_file_id=upload(client, jsonl(lines)).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    done = file_lines(client, finished(client, batch.id).output_file_id)
    assert [answer(done[str(i)]["response"]["body"]) for i in range(len(chats))] == alone
    # And in process: the same model in a Generator of its own, the same bits.
    model, tokenizer = tiny_llama()
    with SyncGenerator(
        model, tokenizer=tokenizer, dtype="bfloat16", deterministic=True, max_prefill_tokens=16
    ) as gen:
        local = [
            gen.generate(
                messages=body["messages"],
                max_new_tokens=body["max_tokens"],
                temperature=body["temperature"],
                seed=body.get("seed"),
                logprobs=0,
            )
            for body in chats
        ]
    assert [(r.text, [t.logprob for t in r.logprobs or ()]) for r in local] == alone
