"""``batchline demo``: the whole service on one machine, on a real model.

Without ``BATCHLINE_REDIS_URL`` it starts a private real Redis (the newest redis-server
found, on a unix socket), with the queue's functions loaded (Redis >= 7). It starts one
worker process serving all-MiniLM-L6-v2 (offline), sends generated sentences through an
AsyncProducer at a rising rate with a live progress bar, and reports what it measured: the
rate it served while saturated and its share of the model's ceiling, latency and batch size
per load step, padding efficiency, and the nearest-neighbour pairs that show the embeddings
are real. The ceiling is the worker's own: its model's time on its fullest batches during
the run (the results carry each batch's size and model time), so it is measured in the same
process, on the same threads, at the same moment as what it is compared with, and the share
is the part of the time the model was busy. ``--plot`` draws served vs offered throughput
(with the ceiling), latency and batch size against load. Everything it started is stopped
on the way out; Ctrl-C, in any phase, prints one line, stops it and exits 130.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import RedisError

from batchline.demo.embedded import EmbeddedRedis, RedisServer
from batchline.demo.load import open_loop
from batchline.demo.report import Step, draw, report
from batchline.demo.sentences import labelled_sentences
from batchline.drivers._options import DEFAULTS
from batchline.transport import EXIT_INTERRUPTED
from batchline.worker._supervisor import die_with_parent

__all__ = ["run_service_demo"]

T = TypeVar("T")
RATES = (20, 40, 80, 160, 320, 640)  # offered requests per second, one step each
#: The demos' producer settings: no bound on the queue (the load is the point), and no
#: warning of a missing worker while theirs loads its model (they say they wait for it).
PRODUCER_SETTINGS: dict[str, Any] = {"max_queue_depth": 0, "no_worker_log_s": 120.0}
#: What drives a demo: its coroutine, given Redis's URL and the producer's settings.
Drive = Callable[[str, dict[str, Any]], Awaitable[T]]


def start_worker(url: str, queue: str, settings: list[str]) -> subprocess.Popen[bytes]:
    """A ``batchline worker`` process serving ``queue`` with these settings (flags)."""
    env = dict(os.environ, BATCHLINE_REDIS_URL=url, BATCHLINE_QUEUE=queue, HF_HUB_OFFLINE="1")
    return subprocess.Popen(
        [sys.executable, "-m", "batchline", "--log-level", "WARNING", "worker", *settings],
        env=env,
        # Its own session: a Ctrl-C at the terminal reaches only the demo, which stops the
        # worker itself, before the Redis it talks to. Killed outright, the demo (or a
        # benchmark using this) takes the worker with it rather than leaving it serving.
        start_new_session=True,
        preexec_fn=die_with_parent,  # noqa: PLW1509 - only prctl, before exec
    )


def stop_worker(process: subprocess.Popen[bytes], wait_s: float = 30.0) -> None:
    """SIGTERM (the worker drains), then SIGKILL if it has not exited within ``wait_s``."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(wait_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _drive(
    url: str,
    producer_settings: dict[str, Any],
    queue: str,
    pairs: list[tuple[str, str]],
    step_s: float,
) -> tuple[list[Step], list[Any], dict[str, Any], float]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from batchline.producer import AsyncProducer
    from batchline.transport import connect
    from batchline.transport.status import collect

    texts = [t for _, t in pairs]
    vectors: list[Any] = [None] * len(texts)
    steps: list[Step] = []
    async with AsyncProducer(redis_url=url, queue=queue, **producer_settings) as producer:
        await producer.infer("warm-up: wait until the worker has loaded its model", timeout_s=300)
        print("model loaded; sending sentences at a rising rate (Ctrl-C stops)", flush=True)
        began = time.perf_counter()
        done = 0

        async def one(i: int, step: Step, progress: Progress, task: Any) -> None:
            nonlocal done
            t0 = time.perf_counter()
            handle = await producer.submit(texts[i])
            result = await producer.wait(handle, timeout_s=600)
            step.latencies_ms.append((time.perf_counter() - t0) * 1e3)
            step.answered_at.append(time.perf_counter())
            step.sent_at.append(t0)
            step.batch_sizes.append(result.batch_size)
            step.model_ms.append(result.model_ms)
            vectors[i] = result.unwrap()
            done += 1
            progress.update(task, completed=done)

        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns, transient=False) as progress:
            task = progress.add_task("answered", total=len(texts))
            pending: list[asyncio.Task[None]] = []
            i = 0
            try:
                for rate in RATES:
                    step = Step(rate)
                    steps.append(step)
                    progress.update(task, description=f"offered {rate:>4} req/s")
                    count = min(len(texts) - i, int(rate * step_s))

                    def send(k: int, step: Step = step, first: int = i) -> None:
                        pending.append(asyncio.create_task(one(first + k, step, progress, task)))
                        step.sent += 1

                    # Open-loop arrivals at the step's rate: the load does not wait.
                    step.started = await open_loop(rate, count, send)
                    step.ended = time.perf_counter()
                    i += count
                    if i >= len(texts):
                        break
                progress.update(task, description="draining")
                await asyncio.gather(*pending)
            finally:
                # Interrupted (Ctrl-C cancels this task): end the requests in flight here,
                # before the producer closes under them, so that no task is left unawaited.
                for request in pending:
                    request.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.perf_counter() - began
        client = connect(producer.settings)
        try:
            status = await collect(producer.settings, client)
        finally:
            await client.aclose()
    return steps, vectors, status, elapsed


async def forget(url: str, queue: str) -> None:
    """Delete the demo queue's keys from a Redis that is not ours (results expire anyway)."""
    from pydantic import SecretStr

    from batchline.config import ServiceSettings
    from batchline.transport import connect

    settings = ServiceSettings(redis_url=SecretStr(url), queue=queue)
    client = connect(settings)
    try:
        keys = [k async for k in client.scan_iter(match=f"{settings.keys.base}:*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


def redis_for_demo(
    stack: contextlib.ExitStack, queue: str, server: RedisServer | None = None
) -> tuple[str, dict[str, Any]]:
    """BATCHLINE_REDIS_URL, or ``server`` (default: the newest redis-server found) started
    privately (stopped with ``stack``), saying which (its version and path); with the
    queue's functions loaded there, as its worker will once its model is loaded, so that
    the demo's requests go through them from the first. Its URL, and the settings of the
    demo's producer."""
    url = os.environ.get("BATCHLINE_REDIS_URL")
    if url:
        said = f"using Redis at BATCHLINE_REDIS_URL, queue {queue}"
    else:
        redis = EmbeddedRedis(server)
        stack.callback(redis.stop)
        url = redis.start()
        said = f"started a private {redis.server} on {url}"
    functions = asyncio.run(_load_functions(url, queue))
    print(said + ("" if functions else " (Redis < 7: the enqueue script)"), flush=True)
    return url, {**PRODUCER_SETTINGS, "admission": "auto" if functions else "scripts"}


async def _load_functions(url: str, queue: str) -> bool:
    """Load the functions of ``queue`` into Redis at ``url`` (and publish their tag): False
    where it has none (< 7)."""
    from pydantic import SecretStr

    from batchline.config import ServiceSettings
    from batchline.transport import connect, load_library

    settings = ServiceSettings(redis_url=SecretStr(url), queue=queue)
    client = connect(settings)
    try:
        return await load_library(client, settings.keys)
    finally:
        await client.aclose()


def serve_and_drive(
    queue: str,
    settings: list[str],
    about: str,
    drive: Drive[T],
    server: RedisServer | None = None,
) -> T | None:
    """Redis (:func:`redis_for_demo`, ``server`` if given), a worker serving ``queue`` with
    ``settings`` (flags), ``about`` printed, then ``drive(url, producer_settings)``'s
    result, once the worker has stopped (drained) and the queue is forgotten on a shared
    Redis. After Ctrl-C, in any of these phases: one
    line, everything started stopped at once, and None."""
    worker = None
    url = ""
    with contextlib.ExitStack() as stack:
        try:
            url, producer_settings = redis_for_demo(stack, queue, server)
            worker = start_worker(url, queue, settings)
            stack.callback(stop_worker, worker)
            print(about, flush=True)
            result = asyncio.run(_run(drive, url, producer_settings))
            stop_worker(worker)
            if os.environ.get("BATCHLINE_REDIS_URL"):
                asyncio.run(forget(url, queue))
            return result
        except KeyboardInterrupt:
            shared = bool(os.environ.get("BATCHLINE_REDIS_URL"))
            started = [
                *(["the worker"] if worker is not None else []),
                *(["Redis"] if url and not shared else []),
            ]
            what = f": stopping {' and '.join(started)}" if started else ""
            print(f"\ninterrupted{what}", file=sys.stderr, flush=True)
            if worker is not None:
                stop_worker(worker, wait_s=2.0)  # a short drain, then SIGKILL: nothing is kept
            if url and shared:
                with contextlib.suppress(RedisError, OSError):
                    asyncio.run(forget(url, queue))
            return None


async def _run(drive: Drive[T], url: str, producer_settings: dict[str, Any]) -> T:
    return await drive(url, producer_settings)


def run_service_demo(
    *,
    requests: int | None = None,
    plot: str | None = None,
    step_s: float = 1.5,
    batch_size: int = DEFAULTS.batch_size,
    timeout_ms: float = DEFAULTS.timeout_ms,
    server: RedisServer | None = None,
) -> int:
    """Run the demo; returns the exit code (130 after Ctrl-C, in any phase).

    ``requests``: most sentences to send (default: all that the load steps send);
    ``server``: the redis-server to start (default: the newest found).
    """
    total = sum(int(rate * step_s) for rate in RATES)
    pairs = labelled_sentences(min(requests, total) if requests else total, seed=11)
    queue = f"demo-{uuid.uuid4().hex[:8]}"
    done = serve_and_drive(
        queue,
        [
            *("--model", "sentence-transformers", "--batch-size", str(batch_size)),
            *("--timeout-ms", str(timeout_ms), "--heartbeat-s", "0.5"),
        ],
        "started a worker process (all-MiniLM-L6-v2, offline); waiting for its model ...",
        lambda url, producer: _drive(url, producer, queue, pairs, step_s),
        server,
    )
    if done is None:
        return EXIT_INTERRUPTED
    steps, vectors, status, wall = done
    try:
        for line in report(steps, vectors, pairs, status, wall, batch_size=batch_size):
            print(line)
        if plot:
            draw(steps, plot, batch_size)
            print(f"plot written to {plot}")
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return 0
