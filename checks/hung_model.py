"""A model that hangs on one input, served with default settings: what it costs the others.

``python -m checks.hung_model [--requests 1000] [--workers 2] [--hang-at 3] [--timeout-s 20]``

It starts its own redis-server (free loopback port, no persistence) and ``--workers``
``batchline worker`` processes serving ``--model`` (default
``tests.support.models_for_tests:hang``: it echoes its inputs, never returns from a batch
holding ``"hang"``, and has an ``example`` for the warm-up batch;
``tests.support.models_for_tests:double_or_die`` hangs the same way and has none) with every
setting at its default (``--worker-arg`` adds flags, e.g.
``--worker-arg=--max-batch-ms=60000``). Once the workers
beat, one producer submits ``--requests`` requests at once, the ``--hang-at``-th of them
``"hang"``, and waits for each at most ``--timeout-s`` seconds from its submission, as a client
with that timeout would. It prints how many of the others were answered in time, how many
timed out, the slowest answer, when the hanging input was dead-lettered (``MaxDeliveries``,
waited for at most ``--dead-letter-s``), and what the workers logged about it (the bound they
judged the call by, the worker processes replaced). Exit status 0 unless a worker could not
start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from batchline import RequestTimeout
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer
from benchmarks.harness import Procs, child_env, log, redis_binary, start_redis

MODEL = "tests.support.models_for_tests:hang"


def _start_workers(procs: Procs, url: str, queue: str, args: argparse.Namespace) -> list[str]:
    names = []
    for i in range(args.workers):
        name = f"worker-{i}"
        argv = [sys.executable, "-m", "batchline", "worker", "--redis-url", url]
        argv += ["--queue", queue, "--model", args.model, *args.worker_arg]
        procs.spawn(name, argv, env=child_env())
        names.append(name)
    client = redis.Redis.from_url(url)
    keys = QueueKeys(queue)
    deadline = time.monotonic() + 120
    while client.zcard(keys.workers) < args.workers:
        if time.monotonic() > deadline or any(procs.procs[n].poll() is not None for n in names):
            tails = "\n".join(procs.log_tail(n) for n in names)
            raise SystemExit(f"the workers did not start:\n{tails}")
        time.sleep(0.1)
    client.close()
    return names


async def _serve(url: str, queue: str, args: argparse.Namespace) -> dict[str, Any]:
    keys = QueueKeys(queue)
    inputs: list[Any] = list(range(args.requests))
    inputs[args.hang_at] = "hang"
    async with AsyncProducer(redis_url=url, queue=queue) as producer:
        started = time.monotonic()
        sent = []
        for x in inputs:
            sent.append((await producer.submit(x), time.monotonic()))
        log(f"submitted {len(inputs)} requests in {time.monotonic() - started:.2f} s")

        async def one(i: int) -> tuple[str, float]:
            handle, at = sent[i]
            try:
                result = await producer.wait(
                    handle, timeout_s=max(0.0, args.timeout_s - (time.monotonic() - at))
                )
            except RequestTimeout:
                return "timeout", time.monotonic() - at
            return result.status, time.monotonic() - at

        outcomes = await asyncio.gather(*(one(i) for i in range(len(inputs))))
        others = [o for i, o in enumerate(outcomes) if i != args.hang_at]
        ok = [t for status, t in others if status == "ok"]
        poison_id = sent[args.hang_at][0].id.encode()
        poison_at = sent[args.hang_at][1]
        dead_after = None
        client = redis.asyncio.Redis.from_url(url)
        try:
            deadline = poison_at + args.dead_letter_s
            while time.monotonic() < deadline:
                dead = await client.xrange(keys.dead) or []
                if any(fields and fields.get(b"id") == poison_id for _, fields in dead):
                    dead_after = time.monotonic() - poison_at
                    break
                await asyncio.sleep(0.1)  # a measurement's poll of another process's state
        finally:
            await client.aclose()
    return {
        "others": len(others),
        "ok_in_time": len(ok),
        "timed_out": sum(1 for status, _ in others if status == "timeout"),
        "other_status": sorted({status for status, _ in others} - {"ok", "timeout"}),
        "slowest_ok_s": round(max(ok), 2) if ok else None,
        "poison_dead_lettered_after_s": None if dead_after is None else round(dead_after, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL, help=f"the workers' model [default {MODEL}]")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--hang-at", type=int, default=3, help="index of the hanging input")
    parser.add_argument("--timeout-s", type=float, default=20.0, help="each client's timeout")
    parser.add_argument("--dead-letter-s", type=float, default=600.0)
    parser.add_argument("--worker-arg", action="append", default=[], help="a worker flag")
    args = parser.parse_args()
    logdir = Path(tempfile.mkdtemp(prefix="bl-hung-"))
    procs = Procs(logdir)
    try:
        url, version = start_redis(procs, child_env(), redis_binary())
        queue = f"hung-{uuid.uuid4().hex[:8]}"
        names = _start_workers(procs, url, queue, args)
        log(f"{version}, {args.workers} workers; logs in {logdir}")
        report = asyncio.run(_serve(url, queue, args))
        logs = "".join((logdir / f"{n}.log").read_text(errors="replace") for n in names)
        report["hung_judged"] = re.findall(r"past (max_batch_ms=[^:]*)", logs)
        report["processes_replaced"] = logs.count("restarting in")
        report["handed_back"] = [int(n) for n in re.findall(r"handed back (\d+) entries", logs)]
    finally:
        procs.stop_all()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
