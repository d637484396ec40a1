"""Soak test: a steady moderate load for a long time; the worker's and Redis's memory must
not keep growing. A short run is in the suite (tests/checks/test_checks.py).

One invocation starts its own redis-server (free loopback port, ``--save "" --appendonly no``)
and one ``python -m batchline worker`` subprocess (the no-op ``echo`` model unless
``--model``), then runs ``--rate`` requests/s from ``--concurrency`` asyncio tasks of one
AsyncProducer in this process for ``--duration`` seconds. Every ``--interval`` seconds it
samples the worker's resident memory (VmRSS in /proc/<pid>/status) and Redis's
``used_memory`` (INFO memory), and prints a row. At the end it prints each one's growth after
the warm-up (the first 20 % of the run): the last sample minus the first sample taken after
the warm-up, and the highest sample after the warm-up minus that same first sample.

Exit status: 0 when neither grew more than ``--max-growth-mib`` (default 10 MiB) after the
warm-up and every request was answered correctly; 1 otherwise; 2 when it could not start.

Result keys live ``--result-ttl-s`` seconds (default 10, well inside the warm-up of the
default run; batchline's own default is 3600), so that their number reaches its steady state
during the warm-up: with an hour-long TTL, Redis memory grows with every request for an hour
by design, which is not a leak.

Usage::

    python -m checks.soak                    # 30 minutes, echo model
    python -m checks.soak --duration 120     # a 2-minute check of the check itself
    python -m checks.soak --model sentence-transformers --rate 50 --inputs text
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis

from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer
from benchmarks.harness import REPO, Procs, child_env, percentile, redis_binary
from benchmarks.harness import start_redis as harness_start_redis

ECHO = "batchline.worker.models:echo"
MIB = 1 << 20


# -- processes -----------------------------------------------------------------------------------


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(15)


def start_redis(binary: str, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server without persistence on a free loopback port (its log in ``workdir``);
    the process and its URL."""
    procs = Procs(workdir)
    url, _version = harness_start_redis(procs, dict(os.environ), binary)
    return procs.procs["redis-server"], url


def start_worker(
    args: argparse.Namespace, url: str, workdir: Path
) -> tuple[subprocess.Popen[bytes], Path]:
    env = child_env()
    log_path = workdir / "worker.log"
    cmd = [sys.executable, "-m", "batchline", "worker", "--redis-url", url]
    cmd += ["--queue", args.queue, "--model", args.model, "--worker-id", "soak-worker"]
    cmd += ["--max-restarts-per-min", "0"]  # no supervisor: the pid sampled is the worker's
    cmd += ["--batch-size", str(args.batch_size), "--result-ttl-s", str(args.result_ttl_s)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + args.start_timeout_s
    while client.zscore(QueueKeys(args.queue).workers, "soak-worker") is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"the worker did not start:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.1)
    client.close()
    return proc, log_path


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# -- load ------------------------------------------------------------------------------------------


@dataclass
class Counts:
    ok: int = 0
    wrong: int = 0
    failed: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)


def make_input(rng: random.Random, inputs: str) -> Any:
    if inputs == "mixed" and rng.random() < 0.3:
        return np.asarray([rng.random() for _ in range(rng.randint(1, 256))], dtype=np.float32)
    n = rng.randint(1, 300)
    return "".join(rng.choices(string.ascii_letters + " ", k=n))


def same(got: Any, want: Any) -> bool:
    if isinstance(want, np.ndarray):
        return isinstance(got, np.ndarray) and np.array_equal(got, want)
    return bool(got == want)


async def load_task(
    producer: AsyncProducer,
    args: argparse.Namespace,
    counts: Counts,
    end: float,
    seed: int,
) -> None:
    rng = random.Random(seed)
    period = args.concurrency / args.rate
    next_at = time.monotonic() + rng.random() * period  # spread the tasks out
    check = args.model == ECHO
    while True:
        now = time.monotonic()
        if now >= end:
            return
        if next_at > now:
            await asyncio.sleep(next_at - now)
        next_at = max(next_at + period, time.monotonic() - period)  # no catch-up bursts
        value = make_input(rng, args.inputs)
        t0 = time.monotonic()
        try:
            out = await producer.infer(value, timeout_s=args.request_timeout_s)
        except Exception as exc:
            counts.failed += 1
            name = type(exc).__name__
            counts.errors[name] = counts.errors.get(name, 0) + 1
            continue
        counts.latencies_ms.append((time.monotonic() - t0) * 1e3)
        if check and not same(out, value):
            counts.wrong += 1
        else:
            counts.ok += 1


async def soak(args: argparse.Namespace, url: str, worker_pid: int) -> int:
    client = redis.Redis.from_url(url)
    counts = Counts()
    started = time.monotonic()
    end = started + args.duration
    warmup_end = started + args.duration * args.warmup
    samples: list[tuple[float, int, int]] = []  # (t, worker rss, redis used_memory)
    header = (
        f"{'t_s':>6} {'worker_rss_MiB':>14} {'redis_used_MiB':>14} {'req/s':>7} "
        f"{'p50_ms':>7} {'p99_ms':>7} {'ok':>8} {'failed':>6}"
    )
    print(header, flush=True)
    async with AsyncProducer(redis_url=url, queue=args.queue) as producer:
        tasks = [
            asyncio.create_task(load_task(producer, args, counts, end, args.seed + i))
            for i in range(args.concurrency)
        ]
        last_done, last_t = 0, started
        next_sample = started
        while True:
            now = time.monotonic()
            if next_sample > now:
                await asyncio.sleep(min(next_sample, end) - now)
            now = time.monotonic()
            rss = rss_bytes(worker_pid)
            used = int(client.info("memory")["used_memory"])
            samples.append((now - started, rss, used))
            done = counts.ok + counts.wrong + counts.failed
            lat, counts.latencies_ms = counts.latencies_ms, []
            rate = (done - last_done) / (now - last_t) if now > last_t else 0.0
            last_done, last_t = done, now
            print(
                f"{now - started:6.0f} {rss / MIB:14.1f} {used / MIB:14.2f} {rate:7.0f} "
                f"{percentile(lat, 50):7.1f} {percentile(lat, 99):7.1f} {counts.ok:8d} "
                f"{counts.failed + counts.wrong:6d}",
                flush=True,
            )
            if now >= end:
                break
            next_sample += args.interval
        await asyncio.gather(*tasks)
    client.close()

    after = [s for s in samples if s[0] >= warmup_end - started]
    if len(after) < 2:
        print("too few samples after the warm-up: run longer or sample more often")
        return 1
    limit = args.max_growth_mib * MIB
    verdicts = []
    print(f"\nafter the warm-up ({args.warmup:.0%} of the run, {warmup_end - started:.0f} s):")
    for name, col in (("worker RSS", 1), ("redis used_memory", 2)):
        base = after[0][col]
        growth = after[-1][col] - base
        peak = max(s[col] for s in after) - base
        ok = growth <= limit and peak <= limit
        verdicts.append(ok)
        print(
            f"  {name:18} from {base / MIB:8.2f} MiB at {after[0][0]:.0f} s: "
            f"end {growth / MIB:+7.2f} MiB, peak {peak / MIB:+7.2f} MiB "
            f"(limit {args.max_growth_mib} MiB) -> {'ok' if ok else 'GREW'}"
        )
    total = counts.ok + counts.wrong + counts.failed
    print(
        f"  requests: {total} in {args.duration:.0f} s ({total / args.duration:.0f}/s); "
        f"{counts.ok} ok, {counts.wrong} wrong output, {counts.failed} failed {counts.errors}"
    )
    answered = counts.wrong == 0 and counts.failed == 0 and counts.ok > 0
    return 0 if all(verdicts) and answered else 1


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--warmup", type=float, default=0.2, help="share of the run not judged")
    p.add_argument("--rate", type=float, default=200.0, help="requests per second in all")
    p.add_argument("--concurrency", type=int, default=32, help="load tasks")
    p.add_argument("--model", default=ECHO, help="the worker's --model")
    p.add_argument(
        "--inputs",
        choices=["mixed", "text"],
        default=None,
        help="mixed (texts and float32 arrays; default for echo) or text (default otherwise)",
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--result-ttl-s", type=int, default=10)
    p.add_argument("--max-growth-mib", type=float, default=10.0)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--start-timeout-s", type=float, default=120.0)
    p.add_argument("--queue", default="soak")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--redis-server", default=None, help="redis-server binary")
    args = p.parse_args(argv)
    if args.inputs is None:
        args.inputs = "mixed" if args.model == ECHO else "text"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="batchline-soak-") as tmp:
        workdir = Path(tmp)
        redis_proc: subprocess.Popen[bytes] | None = None
        worker: subprocess.Popen[bytes] | None = None
        try:
            try:
                redis_proc, url = start_redis(redis_binary(args.redis_server), workdir)
                worker, log_path = start_worker(args, url, workdir)
            except RuntimeError as exc:
                print(exc, file=sys.stderr)
                return 2
            print(
                f"soak: {args.duration:.0f} s, {args.rate:.0f} req/s from {args.concurrency} "
                f"tasks, model {args.model}, worker pid {worker.pid}, "
                f"redis pid {redis_proc.pid}",
                flush=True,
            )
            status = asyncio.run(soak(args, url, worker.pid))
            if worker.poll() is not None:
                print(f"the worker exited with {worker.returncode}:\n{log_path.read_text()}")
                status = 1
            return status
        finally:
            stop(worker)
            stop(redis_proc)


if __name__ == "__main__":
    sys.exit(main())
