"""The fair share of the workers between tenants against first come, first served, in one run.

``python -m benchmarks.fairness [--batch-ms 8] [--item-ms 0.5] [--batch-size 8] [--seconds 6]
[--repeats 3] [--shares 400] [--requests 3000] [--parts abc] [--redis-server PATH]``

It starts its own redis-server (7 or newer: the queue's functions) and, per mode, one
``batchline worker`` on a queue of its own: ``fair`` (``--fair-share true``) and ``fifo``
(``--fair-share false``); the worker of the mode not measured is paused (SIGSTOP). Their
model, :func:`busy`, sleeps ``--batch-ms`` a batch plus ``--item-ms`` per item (a batch
costs little more than one item, as on the hardware batching is for; a worker of fixed
capacity, ``batch_size`` items a full batch's time, that leaves the shared CPU alone;
``--batch-ms 0`` makes a model with nothing to gain from batching). Repeats alternate the
modes' order, and part (c)'s order of tenant and untenanted.

- (a) two tenants of equal weight at one priority on a saturated worker: B offers a tenth of
  the capacity (open loop, Poisson arrivals, ``--seconds``), alone, then with A offering ten
  times as much (B and A together 1.1 x the capacity; A's load comes from a process of its
  own, as another client's would, so that its client-side work, garbage collections
  included, does not stall B's producer); B's p99 latency with A present over B's p99 alone,
  per mode, and the items/s served with both (from the first request sent to the last
  answer). The anchor besides B alone: the least any scheduler that does not stop a batch
  under way can give B with A present, two full batches' time (B's request waits for the
  batch under way, then runs in the next, full of A's);
- (b) weights 3:1 (A 3, B 1 in the tenant store), both backlogged with ``--shares``
  requests each (enqueued while the worker is paused): A's served share over B's, by cost,
  among the requests dispatched while both were backlogged (up to the first tenant's last
  request; in the order dispatched, which the one worker starts them in; inf: B had none
  of it), for the callable model (cost: items) and, on a ``generate`` worker
  (SmolLM2-135M-Instruct, a quarter as many requests; cost: prompt and generated tokens,
  each request's ``max_new_tokens`` drawn from 4-24), per mode (``--no-generation``: not);
- (c) the CPU per request of a tenant's request (enqueued as tenant A, held and dispatched)
  against an untenanted one, on a no-op worker (``echo``, ``--requests`` each, 500 in
  flight), at two paces: sent one at a time (each after the one before was enqueued: a
  call of the functions per request) and 500 at once (the producer's calls carry many, as
  under load): redis-server, the worker and this producer, each process's CPU seconds over the
  run (µs/request) and the difference, and the Redis commands per request (``INFO
  commandstats``: the functions' calls and the commands they make).

``--parts`` runs only the parts it names, any of ``a``, ``b`` and ``c`` (``c`` alone starts
no embedding or generation worker; without ``b``, no generation worker).

It prints medians (with the range of the repeats) and ratios to the anchors it names: B
alone, FIFO, 3:1, untenanted. The machine is shared: compare ratios within a run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from batchline.keys import QueueKeys, TenantKeys
from batchline.producer import AsyncProducer
from batchline.tenants import TenantConfig
from benchmarks.harness import (
    CpuMeter,
    Procs,
    Samples,
    add_redis_server_flag,
    child_env,
    header,
    log,
    machine,
    percentile,
    redis_binary,
    start_redis,
)

MODES = ("fair", "fifo")
_ITEM_MS = "BENCH_FAIRNESS_ITEM_MS"
_BATCH_MS = "BENCH_FAIRNESS_BATCH_MS"


def busy(items: list[Any]) -> list[Any]:
    """The benchmark's model: ``BENCH_FAIRNESS_BATCH_MS`` milliseconds a batch and
    ``BENCH_FAIRNESS_ITEM_MS`` per item, then echo."""
    batch_ms = float(os.environ.get(_BATCH_MS, "8"))
    time.sleep((batch_ms + float(os.environ.get(_ITEM_MS, "0.5")) * len(items)) / 1e3)
    return items


def full_batch_ms(args: argparse.Namespace) -> float:
    """How long the model takes over a full batch."""
    return float(args.batch_ms + args.item_ms * args.batch_size)


class Run:
    """The processes of one run: redis-server, and per mode a worker per kind."""

    def __init__(self, procs: Procs, url: str, args: argparse.Namespace) -> None:
        self.procs, self.url, self.args = procs, url, args
        env = {_ITEM_MS: str(args.item_ms), _BATCH_MS: str(args.batch_ms), "HF_HUB_OFFLINE": "1"}
        self.env = child_env(env)
        self.queues: dict[str, str] = {}

    def worker(self, name: str, model: list[str], *, fair: bool) -> str:
        queue = f"bench-fair-{name}-{uuid.uuid4().hex[:6]}"
        argv = [sys.executable, "-m", "batchline", "--log-level", "WARNING", "worker"]
        argv += ["--redis-url", self.url, "--queue", queue, *model]
        argv += ["--fair-share", "true" if fair else "false", "--max-restarts-per-min", "0"]
        proc = self.procs.spawn(name, argv, env=self.env)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 180
        while not client.zcard(QueueKeys(queue).workers):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"worker {name} did not start:\n" + self.procs.log_tail(name))
            time.sleep(0.1)
        client.close()
        self.queues[name] = queue
        return queue

    def only(self, name: str) -> None:
        """Resume worker ``name``, pause every other."""
        for other in self.queues:
            if other != name:
                self.procs.pause(other)
        self.procs.resume(name)


async def _producers(url: str, queue: str, *, a: str = "A") -> dict[str, AsyncProducer]:
    """A producer per tenant, A (the tenant named ``a``) and B: each reads one reply stream,
    from its start."""
    made = {}
    for key, tenant in (("A", a), ("B", "B")):
        made[key] = await AsyncProducer(redis_url=url, queue=queue, tenant=tenant).start()
    return made


async def _close(producers: dict[str, AsyncProducer]) -> None:
    for producer in producers.values():
        await producer.aclose()


async def _open_loop(
    producer: AsyncProducer, rate: float, seconds: float, lat: list[float]
) -> None:
    """Send at ``rate``/s on average, Poisson arrivals, for ``seconds`` (as the producer's
    tenant); each answer's latency (ms)."""
    tasks = []
    arrivals = random.Random(f"{rate}-{seconds}")

    async def one(k: int) -> None:
        t0 = time.perf_counter()
        handle = await producer.submit(k, cost=1)
        await producer.wait(handle, timeout_s=600)
        lat.append((time.perf_counter() - t0) * 1e3)

    at = started = time.perf_counter()
    k = 0
    while at < started + seconds:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        tasks.append(asyncio.create_task(one(k)))
        at, k = at + arrivals.expovariate(rate), k + 1
    await asyncio.gather(*tasks)


def _tenant_load(url: str, queue: str, tenant: str, rate: float, seconds: float, conn: Any) -> None:
    """A load process's body: a producer as ``tenant``; once ready (it says so on ``conn``)
    and told to go, ``rate``/s for ``seconds`` (:func:`_open_loop`); then it says how many
    were answered and when the last was (unix seconds)."""

    async def main() -> None:
        async with AsyncProducer(redis_url=url, queue=queue, tenant=tenant) as producer:
            await producer.infer(-1, timeout_s=60)  # its reply stream read, warm
            gc.collect()
            gc.freeze()
            conn.send("ready")
            await asyncio.to_thread(conn.recv)
            lat: list[float] = []
            await _open_loop(producer, rate, seconds, lat)
            conn.send((len(lat), time.time()))

    asyncio.run(main())


async def part_a(run: Run, samples: Samples, mode: str) -> None:
    args = run.args
    capacity = args.batch_size * 1000 / full_batch_ms(args)  # items/s
    rate_b = capacity / 10
    queue = run.queues[f"emb-{mode}"]
    # A: a tenant of weight 1, as B (the tenant A has weight 3, for part b), sent from a
    # process of its own (another client's), started and ready before B's runs begin.
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    a_load = spawn.Process(
        target=_tenant_load, args=(run.url, queue, "A1", 10 * rate_b, args.seconds, theirs)
    )
    a_load.start()
    theirs.close()  # the child's end: a child that dies is an EOF here, not a long wait
    producer = await AsyncProducer(redis_url=run.url, queue=queue, tenant="B").start()
    try:
        if not await asyncio.to_thread(ours.poll, 120) or ours.recv() != "ready":
            raise RuntimeError("(a): tenant A's load process did not start")
        # Warm-up, not counted: the worker just resumed (its heartbeat and upkeep catch up),
        # the producer's reply stream is new.
        await _open_loop(producer, rate_b, 1.0, [])
        gc.collect()
        gc.freeze()  # what the process holds so far: out of every full collection's walk
        alone: list[float] = []
        await _open_loop(producer, rate_b, args.seconds, alone)
        with_a: list[float] = []
        started = time.time()
        ours.send("go")
        await _open_loop(producer, rate_b, args.seconds, with_a)
        b_last = time.time()
        if not await asyncio.to_thread(ours.poll, 600):
            raise RuntimeError("(a): tenant A's load process did not finish")
        a_done, a_last = ours.recv()
        served = (len(with_a) + a_done) / (max(a_last, b_last) - started)
    finally:
        await producer.aclose()
        await asyncio.to_thread(a_load.join, 30)
        if a_load.is_alive():
            a_load.kill()
        gc.unfreeze()
    samples.add(f"a {mode} B p99 alone", percentile(alone, 99))
    samples.add(f"a {mode} B p99 with A", percentile(with_a, 99))
    samples.add(f"a {mode} B p99 ratio", percentile(with_a, 99) / percentile(alone, 99))
    samples.add(f"a {mode} items/s", served)
    log(f"(a) {mode}: B p99 alone {percentile(alone, 99):.0f} ms, with A "
        f"{percentile(with_a, 99):.0f} ms; {served:.0f} items/s")  # fmt: skip


def _in_dispatch_order(url: str, queue: str, done: list[Any]) -> list[Any]:
    """``done`` (request id, ...) in the order the fair share moved its requests into the
    work stream: by the entry each got (``rid:<id>`` = ``<hash> @<entry>``, kept after the
    answer)."""
    keys = QueueKeys(queue)
    client = redis.Redis.from_url(url)
    try:
        marks = client.mget([keys.request_input(row[0]) for row in done])
    finally:
        client.close()

    def entry(mark: Any) -> tuple[int, int]:
        ms, _, seq = bytes(mark or b"").partition(b" @")[2].partition(b"-")
        return int(ms or 0), int(seq or 0)

    ordered = sorted(zip(done, marks, strict=True), key=lambda pair: entry(pair[1]))
    return [row for row, _ in ordered]


async def _share(run: Run, worker: str, queue: str, n: int, values: Any) -> float:
    """A's served cost over B's among the requests dispatched while both were backlogged
    with ``n`` each (enqueued while ``worker`` is paused, so that both are from the start):
    up to the first tenant's last request, the whole window the share is defined over (inf:
    B had none of it). In the order dispatched, which is the order the one worker starts
    them (it reads the stream in order; its batches, and its running batch's admissions,
    take them as read): the order of their start times but exact where several start
    together (one batch). Each counts whole, by its real cost: a generation's tokens are
    committed as its sequence joins the batch."""
    done: list[tuple[str, str, int]] = []  # request id, tenant, cost
    producers = await _producers(run.url, queue)

    async def one(tenant: str, handle: Any, cost: int) -> None:
        result = await producers[tenant].wait(handle, timeout_s=600)
        output = result.output
        real = cost
        if isinstance(output, dict) and "prompt_tokens" in output:
            real = int(output["prompt_tokens"]) + len(output.get("token_ids", ()))
        done.append((handle.id, tenant, real))

    run.procs.pause(worker)
    jobs = []
    for i in range(n):
        for tenant in ("A", "B"):
            value, cost = values(tenant, i)
            jobs.append(one(tenant, await producers[tenant].submit(value), cost))
    run.procs.resume(worker)
    try:
        await asyncio.gather(*jobs)
    finally:
        await _close(producers)
    order = _in_dispatch_order(run.url, queue, done)
    last = min(max(k for k, row in enumerate(order) if row[1] == t) for t in ("A", "B"))
    a = sum(cost for _id, tenant, cost in order[: last + 1] if tenant == "A")
    b = sum(cost for _id, tenant, cost in order[: last + 1] if tenant == "B")
    return a / b if b else math.inf


async def part_b(run: Run, samples: Samples, mode: str) -> None:
    rng = random.Random(7)
    share = await _share(
        run, f"emb-{mode}", run.queues[f"emb-{mode}"], run.args.shares, lambda t, i: (f"{t}{i}", 1)
    )
    samples.add(f"b {mode} items A/B", share)
    if f"gen-{mode}" in run.queues:

        def prompt(tenant: str, i: int) -> tuple[Any, int]:
            text = f"{tenant} {i} " * rng.randint(1, 6)
            value: dict[str, Any] = {"prompt": text, "max_new_tokens": rng.randint(4, 24)}
            return value, 0

        queue = run.queues[f"gen-{mode}"]
        share = await _share(run, f"gen-{mode}", queue, run.args.shares // 4, prompt)
        samples.add(f"b {mode} tokens A/B", share)
    shares = [f"{k} {v[-1]:.2f}" for k, v in samples.rows.items() if k.startswith(f"b {mode}")]
    log(f"(b) {mode}: {', '.join(shares)}")


#: Part (c)'s two paces: each request sent after the one before it was enqueued (one
#: request a call of the functions), and 500 sent at once (the producer's calls carry many).
PACES = ("one at a time", "500 at once")


async def part_c(run: Run, samples: Samples, redis_pid: int, rep: int) -> None:
    queue = run.queues["noop"]
    worker_pid = run.procs.procs["noop"].pid
    order = (None, "A") if rep % 2 == 0 else ("A", None)  # repeats alternate the order
    for pace in PACES:
        for tenant in order:  # a producer each: one reply stream each, read from the start
            name = f"{pace}: {'tenant' if tenant else 'untenanted'}"
            async with AsyncProducer(redis_url=run.url, queue=queue, tenant=tenant) as producer:
                await producer.infer(-1, timeout_s=60)  # its reply stream read, warm
                pids = {"redis": redis_pid, "worker": worker_pid, "producer": os.getpid()}
                calls0 = _commands(run.url)
                meter = CpuMeter(pids)
                n = run.args.requests
                for first in range(0, n, 500):
                    values = range(first, min(n, first + 500))
                    if pace == PACES[0]:
                        handles = [await producer.submit(k) for k in values]
                    else:
                        handles = await asyncio.gather(*(producer.submit(k) for k in values))
                    for handle in handles:
                        await producer.wait(handle, timeout_s=600)
                used = meter.done()
                calls = _commands(run.url)
            per = {k: (v - calls0.get(k, 0)) / n for k, v in calls.items() if v > calls0.get(k, 0)}
            log(f"(c) {name}: {sum(used[p] for p in pids) / n * 1e6:.0f} µs/request; commands "
                f"per request: {', '.join(f'{k} {v:.2f}' for k, v in sorted(per.items()))}")  # fmt: skip
            skip = ("info", "hello")
            samples.add(f"c {name} commands", sum(v for k, v in per.items() if k not in skip))
            for proc in pids:
                samples.add(f"c {name} {proc} µs", used[proc] / n * 1e6)
            samples.add(f"c {name} total µs", sum(used[p] for p in pids) / n * 1e6)


def _commands(url: str) -> dict[str, int]:
    """Redis's count of each command so far (``INFO commandstats``)."""
    with redis.Redis.from_url(url) as client:
        stats: dict[str, Any] = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def _report(samples: Samples, args: argparse.Namespace, gen: bool, parts: str = "abc") -> None:
    def cell(key: str, digits: int = 1) -> str:
        med = samples.med(key)
        spread = samples.spread(key)
        return "n/a" if med is None else f"{med:,.{digits}f}" + (f" ({spread})" if spread else "")

    def rat(a: str, b: str) -> str:
        pairs = samples.paired(a, b)
        return f"{statistics.median(pairs):.2f}" if pairs else "n/a"

    print(f"\n{args.repeats} interleaved repeats; medians (range of the repeats)")
    if "c" in parts:
        _report_c(samples, cell, rat)
    if "a" in parts:
        _report_a(samples, args, cell, rat)
    if "b" in parts:
        _report_b(samples, gen, cell)


def _report_a(samples: Samples, args: argparse.Namespace, cell: Any, rat: Any) -> None:
    print("\n(a) two tenants, one priority, saturated worker (A offers 10x B's load)")
    for mode in MODES:
        print(f"{mode:<5} B p99 alone ms {cell(f'a {mode} B p99 alone', 0)}; "
              f"with A ms {cell(f'a {mode} B p99 with A', 0)}; "
              f"with A / alone {cell(f'a {mode} B p99 ratio', 2)}; "
              f"items/s {cell(f'a {mode} items/s', 0)}")  # fmt: skip
    print(f"items/s fair / FIFO: {rat('a fair items/s', 'a fifo items/s')}")
    floor = 2 * full_batch_ms(args)
    fair = samples.med("a fair B p99 with A")
    print(
        f"B p99 with A, fair, over the least a scheduler that does not stop a batch under way "
        f"can give ({floor:.0f} ms, two full batches): {fair / floor if fair else 0:.2f}"
    )


def _report_b(samples: Samples, gen: bool, cell: Any) -> None:
    print("\n(b) weights 3:1, both backlogged: served cost A / B (anchor 3.00)")
    for mode in MODES:
        line = f"{mode:<5} items {cell(f'b {mode} items A/B', 2)}"
        if gen:
            line += f"; tokens {cell(f'b {mode} tokens A/B', 2)}"
        print(line)
    print(f"fair items A/B / 3: {(samples.med('b fair items A/B') or 0) / 3:.3f}")
    if gen:
        print(f"fair tokens A/B / 3: {(samples.med('b fair tokens A/B') or 0) / 3:.3f}")


def _report_c(samples: Samples, cell: Any, rat: Any) -> None:
    print("\n(c) CPU per request, no-op worker: a tenant's (fair share, quotas) against untenanted")
    for pace in PACES:
        print(f"{pace}:")
        for proc in ("redis", "worker", "producer", "total"):
            t, u = f"c {pace}: tenant {proc} µs", f"c {pace}: untenanted {proc} µs"
            diff = [
                x - y
                for x, y in zip(samples.rows.get(t, []), samples.rows.get(u, []), strict=False)
            ]
            added = f"{statistics.median(diff):+.1f}" if diff else "n/a"
            print(f"{proc:<8} tenant {cell(t)} µs; untenanted {cell(u)} µs; "
                  f"added {added} µs; ratio {rat(t, u)}")  # fmt: skip
        print(f"Redis commands per request: tenant {cell(f'c {pace}: tenant commands', 2)}; "
              f"untenanted {cell(f'c {pace}: untenanted commands', 2)}")  # fmt: skip


async def _bounded(what: str, part: Any) -> None:
    """Run one part; one that takes past 10 minutes is left out of the figures (logged)."""
    try:
        await asyncio.wait_for(part, 600)
    except TimeoutError:
        log(f"{what}: no answer within 600 s: left out")


async def _main(run: Run, redis_pid: int, gen: bool) -> None:
    samples = Samples()
    parts = run.args.parts
    for rep in range(run.args.repeats):
        if "c" in parts:
            run.only("noop")
            await _bounded("(c)", part_c(run, samples, redis_pid, rep))
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]) if parts != "c" else ():
            run.only(f"emb-{mode}")
            if "a" in parts:
                await _bounded(f"(a) {mode}", part_a(run, samples, mode))
            if "b" not in parts:
                continue
            if gen:
                run.procs.resume(f"gen-{mode}")
            await _bounded(f"(b) {mode}", part_b(run, samples, mode))
    _report(samples, run.args, gen, parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-ms", type=float, default=8.0)
    parser.add_argument("--item-ms", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shares", type=int, default=400)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--no-generation", action="store_true", help="skip the tokens share")
    parser.add_argument(
        "--parts", default="abc", help="the parts to run: any of a, b, c (default abc)"
    )
    add_redis_server_flag(parser)
    args = parser.parse_args()
    if not args.parts or set(args.parts) - set("abc"):
        parser.error(f"--parts: any of a, b and c, not {args.parts!r}")
    binary = redis_binary(args.redis_server)
    with tempfile.TemporaryDirectory() as tmp:
        procs = Procs(Path(tmp))
        try:
            run = Run(procs, "", args)
            url, version = start_redis(procs, run.env, binary)
            run.url = url
            print(header())
            print(f"- {machine()}; {version}")
            client = redis.Redis.from_url(url)
            store = TenantKeys("batchline")
            client.hset(store.config, "A", TenantConfig(weight=3).to_json())
            client.incr(store.version)
            client.close()
            batch = ["--batch-size", str(args.batch_size), "--timeout-ms", "5"]
            for mode in MODES if args.parts != "c" else ():
                emb = ["--model", "benchmarks.fairness:busy", *batch]
                run.worker(f"emb-{mode}", emb, fair=mode == "fair")
                if not args.no_generation and "b" in args.parts:
                    gen = ["--model", "generate", "--batch-size", "8"]  # SmolLM2-135M-Instruct
                    run.worker(f"gen-{mode}", gen, fair=mode == "fair")
            run.worker("noop", ["--model", "batchline.worker.models:echo", "--batch-size", "64",
                                "--timeout-ms", "0"], fair=True)  # fmt: skip
            time.sleep(1.5)  # the tenants' configs mirrored (checked once a second)
            generation = not args.no_generation and "b" in args.parts
            asyncio.run(_main(run, procs.procs["redis-server"].pid, generation))
        finally:
            procs.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
