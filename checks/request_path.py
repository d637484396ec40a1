"""The package's modules one request passes through Redis: a map of the serving path, counted.

    python3 -m checks.request_path                    # the echo model, a private redis-server
    python3 -m checks.request_path --model sentence-transformers --model-path DIR

A worker and a producer run on one event loop in this process, against a private
redis-server. After a warm-up request (loading, the first batch's set-up), a profiler records
each batchline module with a function called (on any thread) between the producer's call and
its answer, and the script lists them by folder with how many calls each took, then the
count. That is one request's way: the producer's submit and wait, the admission, the
worker's read, intake, batch, model, answer and write, and the reply read back.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

from redis.asyncio import Redis

import batchline
from batchline.demo.embedded import EmbeddedRedis
from batchline.producer import AsyncProducer
from batchline.worker import Worker

PACKAGE = str(Path(batchline.__file__).resolve().parent)


class Calls:
    """The batchline files with a function called while :attr:`on` is set."""

    def __init__(self) -> None:
        self.on = False
        self.files: Counter[str] = Counter()

    def __call__(self, frame: FrameType, event: str, _arg: Any) -> None:
        if self.on and event == "call":
            name = frame.f_code.co_filename
            if name.startswith(PACKAGE):
                self.files[name] += 1


async def _one_request(url: str, args: argparse.Namespace, calls: Calls) -> None:
    worker = Worker(
        model=args.model,
        model_path=args.model_path,
        redis_url=url,
        queue="path",
        heartbeat_s=5,  # the longest period allowed: the request runs just after a beat
        claim_idle_ms=3_600_000,
        metrics_port=0,
    )
    running = asyncio.create_task(worker.run())
    try:
        if not await asyncio.to_thread(worker.ready.wait, 300):
            raise RuntimeError("the worker was not ready within 300 s")
        async with AsyncProducer(redis_url=url, queue="path") as producer:
            await producer.infer(args.value, timeout_s=60)  # the warm-up
            await _just_after_a_heartbeat(url, worker)
            calls.on = True
            await producer.infer(args.value, timeout_s=60)
            calls.on = False
    finally:
        worker.stop()
        await running


async def _just_after_a_heartbeat(url: str, worker: Worker) -> None:
    """Until the worker's next heartbeat, and half a second more (the upkeep of the same
    period runs about then): the request's window, far shorter than the period, then holds
    no upkeep beat."""
    client = Redis.from_url(url)
    try:
        last = await client.zscore(worker.keys.workers, worker.worker_id)
        while True:
            await asyncio.sleep(0.05)  # a look at the worker set, not a wait for work
            if await client.zscore(worker.keys.workers, worker.worker_id) != last:
                break
    finally:
        await client.aclose()
    await asyncio.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m checks.request_path", description=__doc__)
    parser.add_argument("--model", default="batchline.worker.models:echo")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--value", default="hello world", help="the request's input")
    args = parser.parse_args(argv)
    calls = Calls()
    redis = EmbeddedRedis()
    url = redis.start()
    sys.setprofile(calls)
    threading.setprofile(calls)
    try:
        asyncio.run(_one_request(url, args, calls))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        redis.stop()
    root = Path(PACKAGE).parent
    for name in sorted(calls.files):
        print(f"{calls.files[name]:6d}  {Path(name).relative_to(root)}")
    print(f"{len(calls.files)} modules of batchline on one request's way ({args.model})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
