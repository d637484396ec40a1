"""What admission through the queue's functions costs against the enqueue script, in one run.

``python -m benchmarks.admission [--requests 20000] [--inflight 1000] [--idle 300]
[--burst 256] [--bursts 30] [--repeats 5]``

On Redis >= 7 producers append to the queue's inbox through its functions and a worker
admits it into the work streams (docs/protocol.md, Admission): one more step per request
than the enqueue script, which adds the entries itself. This starts its own redis-server
(the newest found, or ``--redis-server PATH``; 7 or newer) and one no-op
``batchline worker`` (``batchline.worker.models:echo``), and measures, alternating the two
ways repeat by repeat (``admission="functions"`` and ``"scripts"``, one producer each):

- throughput: ``--requests`` requests, ``--inflight`` at a time, requests/s end to end;
- idle latency: ``--idle`` requests one at a time, p50 and p99 (ms);
- an interactive request behind a burst: ``--burst`` requests of the lowest priority sent
  at once, then one of the highest in the same write (so that, through the functions, it
  waits in the inbox behind the burst), ``--bursts`` times: the interactive request's
  latency, p50 and p99 (ms), from its ``submit`` to its answer (the enqueue script adds
  the entries itself, with no inbox: the anchor);
- redis-server's CPU per request (µs) over the throughput run.

It prints the medians of each and the ratio functions / scripts. The machine is shared:
compare ratios from one run, not absolute figures between runs.
"""

from __future__ import annotations

import argparse
import asyncio
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
    CpuMeter,
    Procs,
    add_redis_server_flag,
    child_env,
    header,
    idle_latencies,
    log,
    machine,
    percentile,
    redis_binary,
    served_rate,
    start_redis,
)

MODES = ("functions", "scripts")
#: The queue's priority levels (the worker's default): the burst goes at the lowest, the
#: interactive request at the highest.
PRIORITIES = 3


async def behind_bursts(producer: AsyncProducer, burst: int, bursts: int) -> list[float]:
    """Milliseconds of one interactive request sent right after ``burst`` requests of the
    lowest priority, ``bursts`` times (each burst answered before the next), sorted."""
    took = []
    for _ in range(bursts):
        low = [
            asyncio.ensure_future(producer.infer(k, priority=0, timeout_s=60)) for k in range(burst)
        ]
        await asyncio.sleep(0)  # the burst's submits queued for the producer's next write
        t0 = time.perf_counter()
        if await producer.infer(-1, priority=PRIORITIES - 1, timeout_s=60) != -1:
            raise AssertionError("a request was answered wrong")
        took.append((time.perf_counter() - t0) * 1e3)
        if await asyncio.gather(*low) != list(range(burst)):
            raise AssertionError("a request was answered wrong")
    return sorted(took)


async def _run(url: str, queue: str, redis_pid: int, args: argparse.Namespace) -> None:
    figures: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    producers = {
        mode: await AsyncProducer(
            redis_url=url, queue=queue, max_queue_depth=0, admission=mode
        ).start()
        for mode in MODES
    }
    try:
        for producer in producers.values():  # warm up both ways
            await served_rate(
                producer, list(range(min(2000, args.requests))), args.inflight, echo=True
            )
        for rep in range(args.repeats):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                producer = producers[mode]
                meter = CpuMeter({"redis": redis_pid})
                rps = await served_rate(
                    producer, list(range(args.requests)), args.inflight, echo=True
                )
                redis_us = meter.done()["redis"] / args.requests * 1e6
                idle = await idle_latencies(producer, args.idle)
                behind = await behind_bursts(producer, args.burst, args.bursts)
                got = figures[mode]
                for name, value in (
                    ("requests/s", rps),
                    ("idle p50 ms", percentile(idle, 50)),
                    ("idle p99 ms", percentile(idle, 99)),
                    ("after a burst p50 ms", percentile(behind, 50)),
                    ("after a burst p99 ms", percentile(behind, 99)),
                    ("redis CPU µs/request", redis_us),
                ):
                    got.setdefault(name, []).append(value)
                log(f"repeat {rep + 1} {mode}: {rps:,.0f} requests/s, idle p50 "
                    f"{percentile(idle, 50):.2f} ms, after a burst p50 "
                    f"{percentile(behind, 50):.2f} ms, redis {redis_us:.1f} µs/request")  # fmt: skip
    finally:
        for producer in producers.values():
            await producer.aclose()
    print(f"\n{args.repeats} interleaved repeats; medians (range); ratio functions / scripts")
    print(f"{'figure':<22} {'functions':>22} {'scripts':>22} {'ratio':>7}")
    for name in figures["functions"]:
        cells = []
        for mode in MODES:
            values = figures[mode][name]
            cells.append(
                f"{statistics.median(values):,.2f} ({min(values):,.1f}-{max(values):,.1f})"
            )
        base = statistics.median(figures["scripts"][name])
        ratio = f"{statistics.median(figures['functions'][name]) / base:.2f}" if base else "-"
        print(f"{name:<22} {cells[0]:>22} {cells[1]:>22} {ratio:>7}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--inflight", type=int, default=1000)
    parser.add_argument("--idle", type=int, default=300)
    parser.add_argument("--burst", type=int, default=256, help="requests in a burst")
    parser.add_argument("--bursts", type=int, default=30, help="bursts a repeat")
    parser.add_argument("--repeats", type=int, default=5)
    add_redis_server_flag(parser)
    args = parser.parse_args()
    binary = redis_binary(args.redis_server)
    env = child_env()
    with tempfile.TemporaryDirectory() as tmp:
        procs = Procs(Path(tmp))
        try:
            url, version = start_redis(procs, env, binary)
            print(header())
            print(f"- {machine()}; {version}")
            queue = f"bench-admission-{uuid.uuid4().hex[:8]}"
            argv = [sys.executable, "-m", "batchline", "--log-level", "WARNING", "worker"]
            argv += ["--redis-url", url, "--queue", queue, "--model"]
            argv += ["batchline.worker.models:echo", "--batch-size", "64", "--timeout-ms", "0"]
            worker = procs.spawn("worker", argv, env=env)
            client = redis.Redis.from_url(url)
            deadline = time.monotonic() + 120
            while not client.zcard(QueueKeys(queue).workers):
                if time.monotonic() > deadline or worker.poll() is not None:
                    raise SystemExit("the worker did not start:\n" + procs.log_tail("worker"))
                time.sleep(0.1)
            if not client.function_list():
                raise SystemExit(f"{version} has no functions: Redis 7 or newer is needed")
            client.close()
            asyncio.run(_run(url, queue, procs.procs["redis-server"].pid, args))
        finally:
            procs.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
