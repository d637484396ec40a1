"""Result-cache benchmark: all-MiniLM-L6-v2 requests/s served through Redis with half of
the texts repeated, with the cache (``cache_ttl_s``) and without, in one run.

One invocation starts its own redis-server (free loopback port, no persistence) and, per
measurement, one ``batchline worker`` process (sentence-transformers, all-MiniLM-L6-v2 on the
CPU, batch 32, timeout_ms 0) on a fresh queue, then drives it from this process: one
AsyncProducer, ``--inflight`` requests in flight (closed loop), ``--requests`` requests of
which half repeat a text sent earlier in the run (each distinct text is sent twice, in a
shuffled order: a repeat may come while its first copy is still queued or running, and is
then coalesced, or after it, and is then a cache hit). Without the cache every request is
computed. Before each measurement the worker sees 64 other texts (first batches of each
shape are slower). The two sides alternate, ``--repeats`` (3) times each, each repeat in the
other order than the last; a worker not being measured has exited.

The machine is shared: compare the two columns of one run (their ratio), not runs.

Usage::

    python -m benchmarks.cache                    # ~5 min on 2 busy cores
    python -m benchmarks.cache --requests 100 --repeats 1   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import (
    REPO,
    Procs,
    add_redis_server_flag,
    fmt,
    header,
    log,
    machine,
    provenance,
    redis_binary,
    snapshot,
    start_redis,
)

MODEL = "sentence-transformers"


def workload(requests: int, seed: int) -> tuple[list[str], list[str]]:
    """The measured texts (each distinct one twice, shuffled) and the warm-up texts."""
    from batchline.demo.sentences import sentences

    distinct = sentences(requests // 2 + 64, seed=seed)
    measured, warmup = distinct[64:] * 2, distinct[:64]
    random.Random(seed).shuffle(measured)
    return measured, warmup


async def drive(url: str, queue: str, texts: list[str], inflight: int, cache_ttl_s: int) -> float:
    """Send every text (closed loop, ``inflight`` lanes); the seconds it took."""
    from batchline.producer import AsyncProducer

    async with AsyncProducer(redis_url=url, queue=queue, cache_ttl_s=cache_ttl_s) as producer:
        todo = iter(texts)

        async def lane() -> None:
            for text in todo:
                vector = await producer.infer(text, timeout_s=600)
                if len(vector) != 384:
                    raise RuntimeError(f"an embedding of {len(vector)} values")

        start = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(inflight)))
        return time.perf_counter() - start


def measure(
    procs: Procs, env: dict[str, str], url: str, args: argparse.Namespace, *, cache: bool, rep: int
) -> tuple[float, dict[str, float]]:
    """One measurement on a fresh queue and worker: requests/s, and the queue's counters."""
    import redis

    from batchline.keys import QueueKeys
    from batchline.transport import once_figures

    queue = f"{'cache' if cache else 'plain'}-{rep}"
    ttl = 600 if cache else 0
    name = f"worker-{queue}"
    argv = [sys.executable, "-m", "batchline", "--log-level", "WARNING", "worker"]
    argv += ["--redis-url", url, "--queue", queue, "--model", MODEL, "--batch-size", "32"]
    argv += ["--timeout-ms", "0", "--max-restarts-per-min", "0", "--cache-ttl-s", str(ttl)]
    procs.spawn(name, argv, env=env)
    client = redis.Redis.from_url(url)
    keys = QueueKeys(queue)
    deadline = time.monotonic() + 300
    while not client.zcard(keys.workers):
        if time.monotonic() > deadline or procs.procs[name].poll() is not None:
            raise RuntimeError(f"{name} did not start:\n{procs.log_tail(name)}")
        time.sleep(0.1)
    texts, warmup = workload(args.requests, seed=rep)
    asyncio.run(drive(url, queue, warmup, args.inflight, ttl))
    client.delete(keys.once_stats)  # count the measured requests only
    elapsed = asyncio.run(drive(url, queue, texts, args.inflight, ttl))
    figures = once_figures(client.hgetall(keys.once_stats))
    client.close()
    procs.stop(name)
    return len(texts) / elapsed, figures


def enqueue_cost(url: str, calls: int) -> dict[str, float]:
    """Redis's time per request of the enqueue script (``calls`` calls of 512 new requests,
    distinct texts): the short call (only adds entries), the full call with the cache off
    (resubmit checks) and on (a cache look-up and an in-flight mark as well). Microseconds
    per request, the median of the calls; the work streams are emptied between calls."""
    import msgpack
    import redis
    from redis.typing import EncodableT

    from batchline.codec import encode_request
    from batchline.keys import QueueKeys
    from batchline.transport import ENQUEUE

    client = redis.Redis.from_url(url)
    sha = client.script_load(ENQUEUE)
    out: dict[str, float] = {}
    for mode in ("short", "full, cache off", "full, cache on"):
        keys = QueueKeys(f"cost-{mode.replace(' ', '').replace(',', '-')}")
        client.set(keys.model, "m")
        full = [keys.result(""), keys.request_input(""), keys.waiters(""), keys.cache("")]
        full += [keys.in_flight(""), keys.model, keys.once_stats]
        streams = [keys.stream(p) for p in range(keys.priorities)]
        times = []
        for call in range(calls):
            batch = []
            for i in range(512):
                rid = f"c{call}-{i}"
                fields = encode_request(
                    rid, f"text {rid}", priority=1, enqueued_unix_ms=0, reply="p"
                )
                batch.append([1, [x for kv in fields.items() for x in kv]])
            args: list[EncodableT] = [0, msgpack.packb(batch, use_bin_type=False)]
            if mode != "short":
                args += [3600, 600 if mode.endswith("on") else 0, *full]
            start = time.perf_counter()
            client.evalsha(sha, len(streams), *streams, *args)
            times.append(time.perf_counter() - start)
            client.delete(*streams)
        out[mode] = statistics.median(times) / 512 * 1e6
    client.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="measured requests per run")
    parser.add_argument("--inflight", type=int, default=64, help="requests in flight")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per side")
    add_redis_server_flag(parser)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    src = snapshot(workdir / "src")  # edits during the run: not seen
    measured = provenance(src, copy_of=REPO)
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1"}
    procs = Procs(workdir)
    rates: dict[bool, list[float]] = {False: [], True: []}
    counters: list[dict[str, float]] = []
    try:
        url, version = start_redis(procs, env, redis_binary(args.redis_server))
        cost = enqueue_cost(url, calls=20)
        for rep in range(args.repeats):
            for cache in (False, True) if rep % 2 == 0 else (True, False):
                rate, figures = measure(procs, env, url, args, cache=cache, rep=rep)
                log(f"repeat {rep + 1}, cache {'on' if cache else 'off'}: {rate:,.0f} requests/s")
                rates[cache].append(rate)
                if cache:
                    counters.append(figures)
    finally:
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    ratios = [b / a for a, b in zip(rates[False], rates[True], strict=True)]
    last = counters[-1]
    print("## batchline result cache: all-MiniLM-L6-v2, half of the texts repeated")
    print(header(measured))
    print(f"- {machine()}; {version}")
    print(f"- {args.requests} requests ({args.requests // 2} distinct texts, each twice), "
          f"{args.inflight} in flight, one worker (batch 32, timeout_ms 0), {args.repeats} "
          "repeats per side, alternating, each repeat in the other order")  # fmt: skip
    print(f"- without the cache: {fmt(off)} requests/s (runs: "
          f"{', '.join(fmt(r) for r in rates[False])})")  # fmt: skip
    print(f"- with the cache:    {fmt(on)} requests/s (runs: "
          f"{', '.join(fmt(r) for r in rates[True])})")  # fmt: skip
    print(f"- ratio with/without: {statistics.median(ratios):.2f}x (per repeat: "
          f"{', '.join(f'{r:.2f}' for r in ratios)})")  # fmt: skip
    print(f"- last run's counters: {last['miss']:.0f} computed (misses), {last['hit']:.0f} "
          f"cache hits, {last['coalesced']:.0f} coalesced (hit rate {last['hit_rate']:.1%}); "
          f"{(last['hit'] + last['coalesced']) / max(1, args.requests):.0%} of the requests "
          "served without a model call")  # fmt: skip
    print("- the enqueue script's time in Redis per request, 512 new requests per call "
          "(includes the client's round trip): "
          + ", ".join(f"{mode} {us:.1f} µs" for mode, us in cost.items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
