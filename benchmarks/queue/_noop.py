"""Parts (a) and (b) of the queue benchmark: the no-op model (``batchline.worker.models:echo``).

(a) end-to-end requests/s and latency under load from ``--producers`` load generator
    processes (``_roles.py``), beside arq doing the same no-op as one job per request;
    batchline and arq repeats are interleaved, the side not measured paused with SIGSTOP.
(b) idle latency: one request at a time on the idle no-op worker, over the no-op's own time.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio

from benchmarks.harness import CpuMeter, log, percentile
from benchmarks.queue._roles import (
    Loaders,
    drive,
    quit_loaders,
    safe_close,
    spawn_arq_worker,
    spawn_load,
    summarise,
)
from benchmarks.queue._service import Bench


@dataclass
class NoopRun:
    """The processes of parts (a) and (b): the no-op worker, its load generators, arq's."""

    queue: str
    wpid: int
    wid: str
    each_inflight: int
    bl: Loaders
    arq: Loaders = field(default_factory=dict)
    arq_pid: int = 0


def part_ab(bench: Bench) -> None:
    cfg = bench.cfg
    run = _start(bench)
    _warm_up(bench, run)
    for rep in range(cfg.repeats):
        if "a" in cfg.parts:
            rps = _measure_batchline(bench, run, rep)
            if run.arq:
                _measure_arq(bench, run, rep, rps)
        if "b" in cfg.parts:
            part_b(bench, run.queue, run.wpid, rep)
    _stop(bench, run)


def _start(bench: Bench) -> NoopRun:
    cfg, res = bench.cfg, bench.res
    k = cfg.producers
    each_inflight = max(1, cfg.inflight // k)
    queue = "bench-noop"
    wpid, wid = bench.spawn_worker("noop-worker", queue, "batchline.worker.models:echo")
    bl = {
        f"bl-producer-{i}": spawn_load(bench, f"bl-producer-{i}", "producer", queue, each_inflight)
        for i in range(k)
    }
    run = NoopRun(queue, wpid, wid, each_inflight, bl)
    arq = arq_found(cfg.arq_python) if "a" in cfg.parts else None
    if "a" in cfg.parts and arq is None:
        res.notes.append(
            f"arq is not installed for {cfg.arq_python} (it pins redis < 6: python -m venv "
            "ARQ && ARQ/bin/pip install arq, then --arq-python ARQ/bin/python): the arq "
            "comparison is left out"
        )
    if arq is not None:
        res.notes.append(f"arq: {arq}")
        run.arq_pid = spawn_arq_worker(bench)
        run.arq = {
            f"arq-client-{i}": spawn_load(
                bench, f"arq-client-{i}", "arq-client", queue, each_inflight
            )
            for i in range(k)
        }
    log(f"(a/b) worker {wid}; {k} producer(s), {each_inflight} in flight each")
    return run


def arq_found(python: str) -> str | None:
    """arq's version, redis-py's beside it, and the Python that has them; None if that
    Python has no arq."""
    code = (
        "from importlib.metadata import version; import arq; "
        "print(f\"arq {version('arq')}, redis-py {version('redis')}\")"
    )
    try:
        done = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
    except OSError:
        return None
    if done.returncode != 0:
        return None
    return f"{done.stdout.strip()} ({python})"


def _warm_up(bench: Bench, run: NoopRun) -> None:
    """Imports, connections, scripts, JIT-less caches; then no result is left behind."""
    cfg, k = bench.cfg, bench.cfg.producers
    drive(bench, run.bl, min(2000, cfg.requests // k), run.each_inflight)
    if run.arq:
        drive(bench, run.arq, min(200, cfg.arq_requests // k), run.each_inflight)
        bench.procs.pause("arq-worker")
    bench.unlink(f"batchline:{{{run.queue}}}:res:*")
    bench.unlink("arq:result:*")


def _pids(bench: Bench, worker: int, loaders: Loaders) -> dict[str, int]:
    pids = {"worker": worker, "redis": bench.procs.procs["redis-server"].pid, "_bench": os.getpid()}
    return pids | {name: p.pid for name, p in loaders.items()}


def _record(bench: Bench, prefix: str, s: dict[str, Any], label: str, rep: int) -> None:
    """One repeat's throughput, latency and failures (``prefix`` a_bl or a_arq)."""
    res = bench.res
    res.add(f"{prefix}_rps", s["rps"])
    res.add(f"{prefix}_p50", s["p50"])
    res.add(f"{prefix}_p99", s["p99"])
    res.add(f"{prefix}_failed", s["errors"] + s["bad"])
    if s["errors"] or s["bad"]:
        res.notes.append(
            f"(a) {label} repeat {rep + 1}: {s['errors']} errors, "
            f"{s['bad']} wrong outputs; {s['first_error']}"
        )


def _measure_batchline(bench: Bench, run: NoopRun, rep: int) -> float:
    """One repeat of (a) through batchline; its requests/s."""
    cfg, res = bench.cfg, bench.res
    before = bench.worker_stats(run.queue, run.wid)
    meter = CpuMeter(_pids(bench, run.wpid, run.bl))
    replies = drive(bench, run.bl, cfg.requests // cfg.producers, run.each_inflight)
    cpu = meter.done()
    s = summarise(replies)
    after = bench.worker_stats(run.queue, run.wid, newer_than=time.time())
    record_cpu(bench, "a_bl", cpu, s["n"], run.bl)
    res.add("a_bl_batch", bench.batch_delta(before, after))
    _record(bench, "a_bl", s, "batchline", rep)
    log(
        f"(a) batchline #{rep + 1}: {s['rps']:,.0f} req/s, p50 {s['p50']:.1f} ms, "
        f"p99 {s['p99']:.1f} ms, sent {s['n']:,}, ok {s['ok']:,}, "
        f"batch {res.rows['a_bl_batch'][-1] if res.rows.get('a_bl_batch') else 0:.1f}"
        f", other load {cpu['_other_cores']:.2f} cores"
    )
    bench.unlink(f"batchline:{{{run.queue}}}:res:*")
    return float(s["rps"])


def _measure_arq(bench: Bench, run: NoopRun, rep: int, bl_rps: float) -> None:
    """One repeat of (a) through arq, batchline's worker paused meanwhile."""
    cfg, res = bench.cfg, bench.res
    bench.procs.pause("noop-worker")
    bench.procs.resume("arq-worker")
    meter = CpuMeter(_pids(bench, run.arq_pid, run.arq))
    a = summarise(drive(bench, run.arq, cfg.arq_requests // cfg.producers, run.each_inflight))
    cpu = meter.done()
    bench.procs.pause("arq-worker")
    bench.procs.resume("noop-worker")
    record_cpu(bench, "a_arq", cpu, a["n"], run.arq)
    _record(bench, "a_arq", a, "arq", rep)
    res.add("a_ratio", bl_rps / a["rps"])
    log(
        f"(a) arq       #{rep + 1}: {a['rps']:,.0f} req/s, p50 {a['p50']:.1f} "
        f"ms, p99 {a['p99']:.1f} ms, sent {a['n']:,}; other load "
        f"{cpu['_other_cores']:.2f} cores"
    )
    bench.unlink("arq:result:*")
    bench.unlink("arq:job:*")


def _stop(bench: Bench, run: NoopRun) -> None:
    res = bench.res
    hung = quit_loaders(bench, run.bl)
    arq_counts = quit_loaders(bench, run.arq) if run.arq else {}
    if hung["aclose_hung"]:
        res.notes.append(
            f"AsyncProducer.aclose() hung in {hung['aclose_hung']} producer "
            "process(es) (redis-py swallowed the reply reader's cancellation); "
            "worked around by cancelling it again"
        )
    if arq_counts.get("arq_result_not_found"):
        res.info["arq_retries"] = str(arq_counts["arq_result_not_found"])
    if run.arq:
        # arq's worker sometimes ignores SIGTERM (its main task's cancellation is lost
        # the same way as the producer's, above): it is killed after 5 s then.
        res.info["arq_worker_exit"] = str(bench.procs.stop("arq-worker", timeout_s=5.0))
    rc = bench.procs.stop("noop-worker")
    res.info["noop_worker_exit"] = str(rc)


def record_cpu(bench: Bench, prefix: str, cpu: dict[str, float], n: int, loaders: Loaders) -> None:
    res = bench.res
    res.add(f"{prefix}_cpu_worker_us", cpu["worker"] / n * 1e6)
    res.add(f"{prefix}_cpu_redis_us", cpu["redis"] / n * 1e6)
    res.add(f"{prefix}_cpu_producers_us", sum(cpu[name] for name in loaders) / n * 1e6)
    res.add(
        f"{prefix}_cpu_cores",
        sum(v for k, v in cpu.items() if not k.startswith("_")) / cpu["_wall"],
    )
    res.add(f"{prefix}_other_cores", cpu["_other_cores"])


# -- (b): idle latency -------------------------------------------------------------------------


def _model_ms() -> float:
    """The model's own time: the no-op batch function on one item, in process."""
    from batchline.worker.models import echo

    item = ["x" * 24]
    t = time.perf_counter()
    for _ in range(10000):
        echo(item)
    return (time.perf_counter() - t) / 10000 * 1e3


@dataclass
class Idle:
    """What part (b) measured in one repeat (latencies in ms)."""

    lat: list[float] = field(default_factory=list)  # back to back
    gapped: list[float] = field(default_factory=list)  # each after a 2 ms pause
    ping: list[float] = field(default_factory=list)  # PING round trips, the anchor
    worker_model: list[float] = field(default_factory=list)
    queue_ms: list[float] = field(default_factory=list)
    cpu_us: dict[str, float] = field(default_factory=dict)  # per back-to-back request
    ping_cpu_us: dict[str, float] = field(default_factory=dict)  # per PING
    closed: bool = True


async def _idle_requests(url: str, queue: str, n: int, pids: dict[str, int]) -> Idle:
    """After 20 of each to warm up: ``n`` PING round trips (the anchor: one round trip to
    Redis and back, with redis-py on the producer's event loop), ``n`` sequential requests
    back to back (the target), then ``n`` with a 2 ms pause before each (the processes go to
    sleep in between, as on a quiet service); the CPU each of ``pids`` used per PING and per
    back-to-back request."""
    from batchline.producer import AsyncProducer

    producer = AsyncProducer(redis_url=url, queue=queue, max_queue_depth=0)
    await producer.start()
    out = Idle()
    client = redis.asyncio.Redis.from_url(url)

    async def ping() -> float:
        t0 = time.perf_counter()
        await client.ping()
        return (time.perf_counter() - t0) * 1e3

    async def request(i: int) -> tuple[float, Any]:
        value = f"idle-{i:06d}-xxxxxxxxxxxx"
        t0 = time.perf_counter()
        result = await producer.wait(await producer.submit(value), timeout_s=10)
        dt = (time.perf_counter() - t0) * 1e3
        if result.output != value:
            raise RuntimeError(f"idle request {i}: {result}")
        return dt, result

    try:
        for _ in range(20):  # warm-up
            await ping()
            await request(-1)
        meter = CpuMeter(pids)
        out.ping = [await ping() for _ in range(n)]
        used = meter.done()
        out.ping_cpu_us = {name: used[name] / n * 1e6 for name in pids}
        meter = CpuMeter(pids)
        for i in range(n):
            dt, result = await request(i)
            out.lat.append(dt)
            out.worker_model.append(result.model_ms)
            out.queue_ms.append(result.queue_ms)
        used = meter.done()
        out.cpu_us = {name: used[name] / n * 1e6 for name in pids}
        for i in range(n):
            await asyncio.sleep(0.002)
            out.gapped.append((await request(i))[0])
    finally:
        await client.aclose()
        out.closed = await safe_close(producer)
    return out


def part_b(bench: Bench, queue: str, wpid: int, rep: int) -> None:
    cfg, res = bench.cfg, bench.res
    model_ms = _model_ms()
    pids = {"worker": wpid, "producer": os.getpid(), "redis": bench.procs.procs["redis-server"].pid}
    meter = CpuMeter(pids)
    idle = asyncio.run(_idle_requests(bench.url, queue, cfg.idle_requests, pids))
    other = meter.done()["_other_cores"]
    over = sorted(x - model_ms for x in idle.lat)
    gapped = sorted(x - model_ms for x in idle.gapped)
    ping_p50 = percentile(sorted(idle.ping), 50)
    res.add("b_p50", percentile(over, 50))
    res.add("b_p99", percentile(over, 99))
    res.add("b_gap_p50", percentile(gapped, 50))
    res.add("b_gap_p99", percentile(gapped, 99))
    res.add("b_mean", statistics.fmean(over))
    res.add("b_ping_p50", ping_p50)
    res.add("b_in_pings", percentile(over, 50) / ping_p50)
    for name in pids:
        res.add(f"b_cpu_{name}_us", idle.cpu_us[name])
        res.add(f"b_ping_cpu_{name}_us", idle.ping_cpu_us[name])
    res.add("b_worker_model_ms", statistics.median(idle.worker_model))
    res.add("b_queue_ms", statistics.median(idle.queue_ms))
    res.add("b_model_own_us", model_ms * 1e3)
    res.add("b_other_cores", other)
    if not idle.closed:
        res.notes.append(f"(b) repeat {rep + 1}: AsyncProducer.aclose() hung (worked around)")
    cpu = " / ".join(f"{idle.cpu_us[name]:.0f}" for name in pids)
    log(
        f"(b) idle      #{rep + 1}: p50 {percentile(over, 50):.3f} ms, p99 "
        f"{percentile(over, 99):.3f} ms over the model's {model_ms * 1e3:.2f} us "
        f"({len(idle.lat)} sequential requests; {percentile(over, 50) / ping_p50:.1f} PING "
        f"round trips of {ping_p50:.3f} ms; CPU a request worker / producer / Redis {cpu} us; "
        f"with 2 ms pauses p50 {percentile(gapped, 50):.3f}, p99 "
        f"{percentile(gapped, 99):.3f} ms; other load {other:.2f} cores)"
    )
