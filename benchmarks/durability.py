"""What durability "replicated" costs against "async", in one run: the served rates of the
no-op model and of all-MiniLM-L6-v2.

``python -m benchmarks.durability [--requests 10000] [--sentences 1000] [--inflight 500]
[--repeats 3] [--models echo,minilm]``

It starts a Redis primary with one replica (local redis-server processes, no persistence),
and, per model, two ``batchline worker`` processes on two queues: one with ``--durability
async``, one with ``replicated`` (``min_replicas`` 1). Repeats alternate the two ways, the
worker not measured paused (SIGSTOP): each repeat, one producer per way sends ``--requests``
inputs (the no-op model) or ``--sentences`` of the demo's sentences (MiniLM), ``--inflight``
at a time, and the served rate is timed end to end. It prints the medians and the ratio
replicated / async. A replica on the same machine is the cheapest a WAIT can be: across a
network, each enqueue write and each answer write waits a round trip more.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer
from benchmarks.harness import (
    Procs,
    add_redis_server_flag,
    child_env,
    free_port,
    header,
    log,
    machine,
    redis_server,
    served_rate,
)

MODES = ("async", "replicated")
MODELS = {"echo": "batchline.worker.models:echo", "minilm": "sentence-transformers"}


def _env() -> dict[str, str]:
    return child_env({"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")})


def _redis(procs: Procs, binary: str) -> str:
    """A primary and a replica in sync; the primary's URL."""
    ports = [free_port(), free_port()]
    for i, port in enumerate(ports):
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(procs.logdir), "--dbfilename", f"{port}.rdb"]
        if i:
            argv += ["--replicaof", "127.0.0.1", str(ports[0])]
        procs.spawn(f"redis-{i}", argv, env=_env())
    primary = redis.Redis(port=ports[0])
    deadline = time.monotonic() + 30
    while True:
        try:
            info = primary.info("replication")
            if info.get("slave0", {}).get("state") == "online":
                break
        except redis.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the replica did not sync")
        time.sleep(0.1)
    primary.close()
    return f"redis://127.0.0.1:{ports[0]}/0"


def _workers(procs: Procs, url: str, model: str) -> dict[str, str]:
    """One worker per way on a queue of its own; the queue of each way."""
    queues = {mode: f"dur-{mode}-{uuid.uuid4().hex[:6]}" for mode in MODES}
    for mode, queue in queues.items():
        argv = [sys.executable, "-m", "batchline", "--log-level", "WARNING", "worker"]
        argv += ["--redis-url", url, "--queue", queue, "--model", MODELS[model]]
        argv += ["--durability", mode, "--min-replicas", "1", "--max-restarts-per-min", "0"]
        procs.spawn(f"worker-{model}-{mode}", argv, env=_env())
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 300
    while not all(client.zcard(QueueKeys(q).workers) for q in queues.values()):
        if time.monotonic() > deadline:
            raise SystemExit("the workers did not start")
        time.sleep(0.2)
    client.close()
    return queues


async def _measure(
    url: str, queues: dict[str, str], procs: Procs, model: str, args: argparse.Namespace
) -> dict[str, list[float]]:
    if model == "echo":
        values: list[object] = list(range(args.requests))
    else:
        from batchline.demo.sentences import sentences

        values = list(sentences(args.sentences))
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    producers = {
        mode: await AsyncProducer(
            redis_url=url, queue=queues[mode], max_queue_depth=0, durability=mode
        ).start()
        for mode in MODES
    }
    try:
        for rep in range(args.repeats + 1):  # the first is a warm-up, not counted
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                other = next(m for m in MODES if m != mode)
                procs.pause(f"worker-{model}-{other}")
                procs.resume(f"worker-{model}-{mode}")
                rate = await served_rate(
                    producers[mode], values, args.inflight, echo=model == "echo"
                )
                if rep:
                    rates[mode].append(rate)
                    log(f"{model} {mode} repeat {rep}: {rate:,.0f}/s")
    finally:
        for producer in producers.values():
            await producer.aclose()
        for mode in MODES:
            procs.resume(f"worker-{model}-{mode}")
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--inflight", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="echo,minilm")
    add_redis_server_flag(parser)
    args = parser.parse_args()
    server = redis_server(args.redis_server)
    print(header())
    print(f"- {machine()}; a primary and one replica on this machine; {server}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        procs = Procs(Path(tmp))
        try:
            url = _redis(procs, server.path)
            for model in args.models.split(","):
                queues = _workers(procs, url, model)
                rates = asyncio.run(_measure(url, queues, procs, model, args))
                rows.append((model, rates))
                for mode in MODES:
                    procs.stop(f"worker-{model}-{mode}")
        finally:
            procs.stop_all()
    print(f"\n{args.repeats} interleaved repeats; served per second, median (range)")
    print(f"{'model':<8} {'async':>24} {'replicated':>24} {'ratio':>7}")
    for model, rates in rows:
        cells = [
            f"{statistics.median(rates[m]):,.0f} ({min(rates[m]):,.0f}-{max(rates[m]):,.0f})"
            for m in MODES
        ]
        ratio = statistics.median(rates["replicated"]) / statistics.median(rates["async"])
        print(f"{model:<8} {cells[0]:>24} {cells[1]:>24} {ratio:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
