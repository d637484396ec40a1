"""``batchline demo --generate``: a few chat prompts answered live through Redis and a
``--model generate`` worker (SmolLM2-135M-Instruct by default), with tokens/s.

As ``batchline demo``: a private redis-server unless ``BATCHLINE_REDIS_URL`` is set, one worker
process, everything stopped on the way out (Ctrl-C, in any phase: one line, exit 130). The
prompts are sent at once, so the worker answers them in one continuous batch; each answer is
printed as it comes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from batchline.demo.embedded import RedisServer
from batchline.demo.service import serve_and_drive
from batchline.transport import EXIT_INTERRUPTED

__all__ = ["PROMPTS", "run_generate_demo"]

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "Give me three tips for learning Python.",
)


async def _ask(
    url: str, producer_settings: dict[str, Any], queue: str, max_new_tokens: int
) -> tuple[list[dict[str, Any]], float]:
    from batchline.producer import AsyncProducer

    async with AsyncProducer(redis_url=url, queue=queue, **producer_settings) as producer:
        # The first answer waits for the model to load (the first run converts SmolLM2 once).
        await producer.infer({"prompt": "Hello", "max_new_tokens": 1}, timeout_s=600)
        print(f"model loaded; asking {len(PROMPTS)} questions at once\n", flush=True)
        started = time.perf_counter()

        async def one(question: str) -> dict[str, Any]:
            value = {
                "messages": [{"role": "user", "content": question}],
                "max_new_tokens": max_new_tokens,
            }
            out: dict[str, Any] = await producer.infer(value, timeout_s=600)
            print(f"> {question}\n{out['text'].strip()}", flush=True)
            print(
                f"  [{out['tokens']} tokens, {out['finish_reason']}; first token after "
                f"{out['ttft_ms']:.0f} ms, done after {out['total_ms']:.0f} ms]\n",
                flush=True,
            )
            return out

        answers = await asyncio.gather(*(one(q) for q in PROMPTS))
        return list(answers), time.perf_counter() - started


def run_generate_demo(
    *,
    model_path: str | None = None,
    max_new_tokens: int = 48,
    server: RedisServer | None = None,
) -> int:
    """Run the demo; returns the exit code (130 after Ctrl-C). ``server``: the redis-server
    to start (default: the newest found)."""
    queue = f"demo-gen-{uuid.uuid4().hex[:8]}"
    settings = ["--model", "generate", "--batch-size", "8", "--heartbeat-s", "0.5"]
    if model_path:
        settings += ["--model-path", model_path]
    done = serve_and_drive(
        queue,
        settings,
        f"started a worker process (--model generate, {model_path or 'SmolLM2-135M'}); "
        "waiting for its model ...",
        lambda url, producer: _ask(url, producer, queue, max_new_tokens),
        server,
    )
    if done is None:
        return EXIT_INTERRUPTED
    answers, wall_s = done
    tokens = sum(a["tokens"] for a in answers)
    print(
        f"{len(answers)} answers, {tokens} tokens in {wall_s:.2f} s: "
        f"{tokens / wall_s:.1f} tokens/s through Redis (one worker, one continuous batch)"
    )
    return 0
