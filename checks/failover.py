"""Failovers under load: how many accepted requests each durability loses, counted.

``python -m checks.failover [--duration 30] [--rate 150] [--failovers 3] [--freeze]
[--durability async,replicated]``

It starts a replicated Redis of local redis-server processes (a primary, two replicas, three
sentinels: tests/support/replicated.py) and two ``batchline worker`` processes that know
only its ``redis+sentinel://`` URL. For each durability in turn (on a fresh Redis), one
producer submits ``--rate`` requests a second for ``--duration`` seconds while the primary
is SIGKILLed (``--freeze``: SIGSTOPped until the sentinels fail it over, then resumed: it
believes it is primary until told otherwise) ``--failovers`` times, evenly spread. A refused
request (not accepted: ``NotReplicated``, ``ServiceUnavailable``, ``EnqueueUncertain``) is
submitted again with its own id, as a client does; an accepted one is never resubmitted.
Then it waits up to ``--drain-s`` for the answers and counts, per durability: accepted,
refused (by error), answered, **lost** (accepted, never answered), wrong (an answer that is
not its input), pushed twice (an answer pushed again, which the producer drops: a caller gets
one answer) and computed twice (two different computations of one request, e.g. rerun after
a failover lost its acknowledgement).
Exit status 0 unless a process could not start.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer
from batchline.producer._replies import ReplyReader
from benchmarks.harness import Procs, child_env, log, machine

from tests.support.replicated import ReplicatedRedis


async def _run(
    servers: ReplicatedRedis, durability: str, args: argparse.Namespace
) -> dict[str, Any]:
    queue = f"failover-{uuid.uuid4().hex[:8]}"
    common: dict[str, Any] = {"redis_url": servers.url, "queue": queue, "durability": durability}
    common["min_replicas"] = 1
    procs = Procs(servers.workdir)
    for i in range(2):
        argv = [sys.executable, "-m", "batchline", "--log-level", "WARNING", "worker"]
        argv += ["--redis-url", servers.url, "--queue", queue, "--durability", durability]
        argv += ["--min-replicas", "1", "--model", "batchline.worker.models:echo"]
        procs.spawn(f"worker-{durability}-{i}", argv, env=child_env())
    pushed: collections.Counter[str] = collections.Counter()
    computed: dict[str, set[tuple[Any, ...]]] = collections.defaultdict(set)
    deliver = ReplyReader.deliver

    def counting(self: ReplyReader, result: Any) -> None:
        pushed[result.id] += 1
        computed[result.id].add((result.worker, result.batch_size, result.model_ms))
        deliver(self, result)

    ReplyReader.deliver = counting  # type: ignore[method-assign]
    refused: collections.Counter[str] = collections.Counter()
    accepted: dict[int, Any] = {}
    failovers = 0
    try:
        async with AsyncProducer(**common) as producer:
            deadline = time.monotonic() + 120
            while not servers.client(servers.primary()).zcard(QueueKeys(queue).workers) >= 2:
                if time.monotonic() > deadline:
                    raise SystemExit("the workers did not start")
                await asyncio.sleep(0.1)

            async def one(i: int) -> None:
                while True:
                    try:
                        accepted[i] = await producer.submit(i, request_id=f"r{i}")
                        return
                    except Exception as exc:  # not accepted: again, with its own id
                        refused[type(exc).__name__] += 1
                    await asyncio.sleep(0.2)

            n = int(args.duration * args.rate)
            at = {int(n * (k + 1) / (args.failovers + 1)) for k in range(args.failovers)}
            tasks = []
            started = time.monotonic()
            for i in range(n):
                tasks.append(asyncio.create_task(one(i)))
                if i in at:
                    await asyncio.to_thread(_fail_over, servers, args.freeze)
                    failovers += 1
                await asyncio.sleep(max(0.0, started + (i + 1) / args.rate - time.monotonic()))
            await asyncio.gather(*tasks)
            answered, lost, wrong = 0, 0, 0
            drain_until = time.monotonic() + args.drain_s
            for value, handle in accepted.items():
                try:
                    result = await producer.wait(
                        handle, timeout_s=max(0.1, drain_until - time.monotonic())
                    )
                except Exception:
                    lost += 1
                    continue
                answered += 1
                wrong += result.output != value
    finally:
        ReplyReader.deliver = deliver  # type: ignore[method-assign]
        procs.stop_all()
    return {
        "durability": durability,
        "sent": n,
        "accepted": len(accepted),
        "refused": dict(refused),
        "answered": answered,
        "lost": lost,
        "pushed twice": sum(1 for c in pushed.values() if c > 1),
        "computed twice": sum(1 for c in computed.values() if len(c) > 1),
        "wrong": wrong,
        "failovers": failovers,
    }


def _fail_over(servers: ReplicatedRedis, freeze: bool) -> None:
    if freeze:
        old = servers.freeze_primary()
        servers.wait_failover(old)
        servers.resume(old)
    else:
        old = servers.kill_primary()
        servers.wait_failover(old)
        servers.restart(old)  # back as a replica: the next failover has two again
    log(f"failed over from {old} to {servers.primary()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=150.0)
    parser.add_argument("--failovers", type=int, default=3)
    parser.add_argument("--freeze", action="store_true")
    parser.add_argument("--durability", default="async,replicated")
    parser.add_argument("--drain-s", type=float, default=60.0)
    args = parser.parse_args()
    print(f"{machine()}; {'frozen' if args.freeze else 'killed'} primaries")
    rows = []
    for durability in args.durability.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            servers = ReplicatedRedis(Path(tmp))
            try:
                rows.append(asyncio.run(_run(servers, durability, args)))
            finally:
                servers.stop()
        log(f"{durability}: {rows[-1]}")
    keys = ["sent", "accepted", "answered", "lost", "wrong", "pushed twice", "computed twice"]
    print(f"\n{'durability':<12}" + "".join(f"{k:>15}" for k in keys) + "  refused")
    for row in rows:
        cells = "".join(f"{row[k]:>15}" for k in keys)
        print(f"{row['durability']:<12}{cells}  {row['refused']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
