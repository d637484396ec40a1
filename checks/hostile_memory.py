"""A worker's memory under hostile writers: a flood of junk on the cancel stream, and
entries far larger than any valid request. A short run is in the suite
(tests/checks/test_checks.py).

One invocation starts its own redis-server and one ``python -m batchline worker`` subprocess
(the no-op ``echo`` model; the helpers of ``checks/soak.py``), answers ``--warmup``
requests, then:

1. writes ``--junk`` cancel entries whose id is ``--junk-bytes`` bytes of junk, and as many
   valid request ids, to the cancel stream;
2. writes ``--big`` work-stream entries of ``--big-mib`` MiB each (a valid request whose
   value data is that large), then one ordinary request, and waits for its answer and for
   the large entries to reach the dead-letter stream.

It samples the worker's resident memory (VmRSS) every 0.2 s and prints, for each step, the
RSS before it and the highest RSS during it and for ``--settle-s`` seconds after, then the
final RSS. Exit status 0 when the worker answered throughout, 1 otherwise.

Usage::

    python -m checks.hostile_memory                     # 40,000 x 4 KiB junk, 2 x 50 MiB
    python -m checks.hostile_memory --junk 4000 --big 1 # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

from batchline.codec import encode_request
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer
from benchmarks.harness import redis_binary
from checks import soak

MIB = 1 << 20


class Sampler:
    """The highest VmRSS of one process since the last ``reset``, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):  # a sampling period, not a poll for work
            self.peak = max(self.peak, soak.rss_bytes(self.pid))

    def reset(self) -> int:
        """The current RSS, which becomes the peak."""
        self.peak = soak.rss_bytes(self.pid)
        return self.peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


async def answered(url: str, queue: str, n: int) -> bool:
    async with AsyncProducer(redis_url=url, queue=queue) as producer:
        values = [f"v{i}" for i in range(n)]
        return bool(await producer.map(values, timeout_s=60) == values)


def cancel_flood(client: redis.Redis, keys: QueueKeys, n: int, junk_bytes: int) -> None:
    for start in range(0, n, 1000):
        with client.pipeline(transaction=False) as pipe:
            for i in range(start, min(n, start + 1000)):
                pipe.xadd(keys.cancels, {"id": b"%08d" % i + b"#" * (junk_bytes - 8)})
                pipe.xadd(keys.cancels, {"id": f"req-{i:032d}"})
            pipe.execute()


def big_entries(client: redis.Redis, keys: QueueKeys, n: int, mib: int) -> None:
    for i in range(n):
        fields = encode_request(f"big-{i}", "x", enqueued_unix_ms=time.time() * 1e3, reply=None)
        fields["blob"] = b"\0" * (mib * MIB)
        client.xadd(keys.stream(0), fields)  # type: ignore[arg-type]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--junk", type=int, default=40_000)
    parser.add_argument("--junk-bytes", type=int, default=4096)
    parser.add_argument("--big", type=int, default=2)
    parser.add_argument("--big-mib", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--redis-server")
    args = parser.parse_args()
    args.queue, args.model, args.batch_size = "hostile", soak.ECHO, 32
    args.result_ttl_s, args.start_timeout_s = 600, 60.0
    keys = QueueKeys(args.queue)
    with tempfile.TemporaryDirectory() as tmp:
        server, url = soak.start_redis(redis_binary(args.redis_server), Path(tmp))
        worker = None
        try:
            worker, _log = soak.start_worker(args, url, Path(tmp))
            client = redis.Redis.from_url(url)
            sampler = Sampler(worker.pid)
            ok = asyncio.run(answered(url, args.queue, args.warmup))
            rows = []
            before = sampler.reset()
            cancel_flood(client, keys, args.junk, args.junk_bytes)
            ok &= asyncio.run(answered(url, args.queue, 100))
            time.sleep(args.settle_s)  # let the cancel reader take the whole flood
            rows.append(
                (
                    f"cancel stream: {args.junk:,} x {args.junk_bytes} B junk ids "
                    f"+ {args.junk:,} valid",
                    before,
                    sampler.peak,
                )
            )
            before = sampler.reset()
            big_entries(client, keys, args.big, args.big_mib)
            ok &= asyncio.run(answered(url, args.queue, 100))
            deadline = time.monotonic() + 120
            while client.xlen(keys.dead) < args.big and time.monotonic() < deadline:
                time.sleep(0.1)  # waiting for the worker to dead-letter them
            ok &= client.xlen(keys.dead) == args.big
            time.sleep(args.settle_s)
            rows.append(
                (f"work stream: {args.big} x {args.big_mib} MiB entries", before, sampler.peak)
            )
            final = soak.rss_bytes(worker.pid)
            sampler.close()
            print(f"{'step':<60} {'RSS before':>11} {'peak':>9}")
            for name, start, peak in rows:
                print(f"{name:<60} {start / MIB:>8.1f} MiB {peak / MIB:>6.1f} MiB")
            print(f"final worker RSS {final / MIB:.1f} MiB; answered throughout: {ok}")
            client.close()
            return 0 if ok else 1
        finally:
            soak.stop(worker)
            soak.stop(server)


if __name__ == "__main__":
    sys.exit(main())
