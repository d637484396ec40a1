"""The through-Redis and via-HTTP rows of the generation benchmark: a private redis-server and one
``--model generate`` worker process (RedisWorker), one producer (through_redis) or the FastAPI
backend's OpenAI route on uvicorn in this process (via_http)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from benchmarks.harness import percentile

if TYPE_CHECKING:
    from batchline.demo.embedded import RedisServer

HEARTBEAT_S = 0.5  # the bench worker's; its statistics (the running batch) come with it

Result = dict[str, Any]


def latencies(ttft: list[float], itl: list[float]) -> Result:
    return {
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
    }


async def through_redis(
    url: str,
    queue: str,
    chats: list[Any],
    limits: list[int],
    gaps: list[float],
    *,
    stream: bool = False,
) -> Result:
    """The same requests through Redis: one producer, the worker started by RedisWorker;
    ``stream``: with ``producer.stream`` instead of ``producer.infer``.

    ``first_s``: until each caller had text (with infer, its answer). The result carries the
    worker's timings, not each token's: time to first token is the client's latency less the
    worker's time from first token to end (it includes Redis both ways); inter-token latency
    is per request, its mean ((total - ttft) / (tokens - 1))."""
    from batchline.producer import AsyncProducer

    async with AsyncProducer(redis_url=url, queue=queue, max_queue_depth=0) as producer:

        async def one(chat: Any, limit: int, delay: float) -> tuple[dict[str, Any], float, float]:
            await asyncio.sleep(delay)
            sent = time.perf_counter()
            value = {"messages": chat, "max_new_tokens": limit}
            if not stream:
                out: dict[str, Any] = await producer.infer(value, timeout_s=3600)
                took = time.perf_counter() - sent
                return out, took, took
            first = None
            async for chunk in producer.stream(value, timeout_s=3600):
                if first is None and chunk.token_ids:
                    first = time.perf_counter() - sent
                if chunk.result is not None:
                    return chunk.result, time.perf_counter() - sent, first or 0.0
            raise AssertionError("a stream ended without its last chunk")

        arrivals = [sum(gaps[: i + 1]) for i in range(len(gaps))]
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(one(c, m, a) for c, m, a in zip(chats, limits, arrivals, strict=True))
        )
        wall = time.perf_counter() - start
    ttft = [took - (o["total_ms"] - o["ttft_ms"]) / 1e3 for o, took, _ in outs]
    itl = [
        (o["total_ms"] - o["ttft_ms"]) / 1e3 / (o["tokens"] - 1)
        for o, _, _ in outs
        if o["tokens"] > 1
    ]
    return {
        "tokens": sum(o["tokens"] for o, _, _ in outs),
        "wall_s": wall,
        **latencies(ttft, itl),
        "first_s": [f for _, _, f in outs],
    }


async def via_http(
    base_url: str, model: str, chats: list[Any], limits: list[int], gaps: list[float]
) -> Result:
    """The same requests streamed through the OpenAI route of the FastAPI backend."""
    import httpx

    ttft: list[float] = []

    async with httpx.AsyncClient(base_url=base_url, timeout=3600) as client:

        async def one(chat: Any, limit: int, delay: float) -> int:
            await asyncio.sleep(delay)
            body = {"model": model, "messages": chat, "max_tokens": limit, "stream": True}
            body["stream_options"] = {"include_usage": True}
            sent, first, tokens = time.perf_counter(), True, 0
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if first:  # sent once the first chunk, the first token, has come
                        ttft.append(time.perf_counter() - sent)
                        first = False
                    usage = json.loads(line[len("data: ") :]).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
            return tokens

        arrivals = [sum(gaps[: i + 1]) for i in range(len(gaps))]
        start = time.perf_counter()
        counts = await asyncio.gather(
            *(one(c, m, a) for c, m, a in zip(chats, limits, arrivals, strict=True))
        )
        wall = time.perf_counter() - start
    return {
        "tokens": sum(counts),
        "wall_s": wall,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
    }


class RedisWorker:
    """A private redis-server (``server``, default the newest found; it says which) and one
    generation worker process, for the through-Redis rows.

    Built before anything is timed: it returns once the worker has loaded its model and
    answered a request, so its loading never overlaps a timed row."""

    def __init__(
        self,
        batch_size: int,
        device: str = "auto",
        dtype: str = "auto",
        model_path: str | None = None,
        server: RedisServer | None = None,
    ) -> None:
        import contextlib

        from batchline.demo.service import redis_for_demo, start_worker, stop_worker

        self.queue = "bench-generate"
        self.stack = contextlib.ExitStack()
        self.url, _producer = redis_for_demo(self.stack, self.queue, server)
        flags = ["--model", "generate", "--batch-size", str(batch_size)]
        flags += ["--device", device, "--dtype", dtype]
        flags += ["--model-path", model_path] if model_path else []
        flags += ["--heartbeat-s", str(HEARTBEAT_S), "--max-restarts-per-min", "0"]
        worker = start_worker(self.url, self.queue, flags)
        self.stack.callback(stop_worker, worker)
        self.base_url: str | None = None
        hello = [[{"role": "user", "content": "Hello"}]]
        asyncio.run(through_redis(self.url, self.queue, hello, [2], [0.0]))  # loaded

    def _steps(self) -> tuple[int, int, float]:
        """(steps, rows) the worker has run, and when its heartbeat said so."""
        import redis

        from batchline.keys import QueueKeys

        keys = QueueKeys(self.queue)
        client = redis.Redis.from_url(self.url)
        try:
            workers = client.zrange(keys.workers, 0, -1)
            first = workers[0] if workers else None  # a member's name, bytes (no scores asked)
            raw = (
                client.get(keys.worker_stats(first.decode())) if isinstance(first, bytes) else None
            )
        finally:
            client.close()
        stats = json.loads(raw) if raw else {}
        histogram = {int(k): v for k, v in stats.get("batch_size_histogram", {}).items()}
        rows = sum(size * n for size, n in histogram.items())
        return sum(histogram.values()), rows, float(stats.get("time", 0.0))

    def run(
        self, chats: list[Any], limits: list[int], gaps: list[float], *, stream: bool = False
    ) -> Result:
        """One workload through Redis; its mean running batch from the worker's heartbeats
        (read after one more heartbeat period: nan if none came)."""
        steps0, rows0, _ = self._steps()
        out = asyncio.run(through_redis(self.url, self.queue, chats, limits, gaps, stream=stream))
        ended = time.time()
        time.sleep(2 * HEARTBEAT_S)  # one heartbeat after the last result
        steps, rows, at = self._steps()
        fresh = at >= ended and steps > steps0
        out["mean_batch"] = (rows - rows0) / (steps - steps0) if fresh else float("nan")
        return out

    def http(self, chats: list[Any], limits: list[int], gaps: list[float]) -> Result:
        """The requests through the FastAPI backend (started on first use) and Redis."""
        if self.base_url is None:
            self.base_url = self._serve()
        return asyncio.run(via_http(self.base_url, self.queue, chats, limits, gaps))

    def _serve(self) -> str:
        """uvicorn on a thread of this process, serving the app for this worker's queue."""
        import socket
        import threading

        import uvicorn

        from batchline.contrib.fastapi import create_app

        app = create_app(
            redis_url=self.url, generation_queue=self.queue, max_queue_depth=0, timeout_s=3600
        )
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not server.started:  # start-up only: a bounded wait on the thread
            thread.join(0.05)
            if not thread.is_alive():
                raise RuntimeError("the FastAPI backend did not start")

        def stop() -> None:
            server.should_exit = True
            thread.join(30)

        self.stack.callback(stop)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def close(self) -> None:
        self.stack.close()
