"""What tracing costs on the no-op model's path through Redis, in one run: tracing off, tracing
on, and the version before tracing.

``python -m benchmarks.tracing [--requests 10000] [--inflight 500] [--idle 300] [--repeats 5]
[--previous REV]``

It starts its own redis-server and, per way, one no-op ``batchline worker``
(``batchline.worker.models:echo``, in its own process: ``--max-restarts-per-min 0``) on a
queue of its own and one producer process that sends to it:

- ``off``: this checkout, tracing off (no ``BATCHLINE_OTEL``, no ``OTEL_*`` exporter);
- ``on``: this checkout, tracing on in the worker and the producer: the OpenTelemetry SDK's
  ``TracerProvider`` with a ``BatchSpanProcessor`` whose exporter drops the spans (every
  span is made, ended and handed to the processor; nothing leaves the box);
- ``previous``: ``batchline/`` of ``--previous`` (the version before tracing is 3ef3d62;
  default: where this branch left ``main``, ``git merge-base HEAD main``, refused where that
  is HEAD itself, as on ``main``), extracted with ``git archive`` and first on the worker's
  and the producer's ``PYTHONPATH``.

Repeats go round the three ways, in a rotating order, the workers not measured paused
(SIGSTOP). Each repeat a way's producer sends ``--requests`` inputs ``--inflight`` at a time
(requests/s end to end), then ``--idle`` one at a time (p50 ms); the worker's and the
producer's CPU per request are read from /proc over both. It prints the medians (range) and
the ratios off / previous and on / off, and whether each way's producer imported
``batchline.tracing._otel``, batchline's only importer of OpenTelemetry (redis-py 8 imports
``opentelemetry`` itself, for its own optional instrumentation, whatever batchline does). The machine is shared: compare ratios from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import REPO, CpuMeter, Procs, Samples, log

WAYS = ("off", "on", "previous")
FIGURES = {  # each figure, and its key in a measurement
    "requests/s": "rps",
    "idle p50 ms": "p50",
    "worker CPU µs/request": "worker_us",
    "producer CPU µs/request": "producer_us",
}


def _traced() -> None:
    """Tracing on in this process: the SDK, its spans handed to an exporter that drops them."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    from batchline import tracing

    class Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    tracing.enable(provider)


def _serve_worker(args: list[str]) -> int:
    """``--serve-worker on|off ARGS``: ``batchline ARGS`` in this process (traced for on)."""
    if args[0] == "on":
        _traced()
    from batchline import cli

    return cli.main(args[1:])


async def _client(url: str, queue: str, way: str) -> None:
    """``--client URL QUEUE WAY``: a producer; each ``go N INFLIGHT IDLE`` line on stdin runs
    one measurement and answers one JSON line on stdout."""
    if way == "on":
        _traced()
    from batchline.producer import AsyncProducer

    producer = await AsyncProducer(redis_url=url, queue=queue, max_queue_depth=0).start()
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            _, n, inflight, idle = line.split()
            rps = await harness.served_rate(producer, list(range(int(n))), int(inflight), echo=True)
            took = await harness.idle_latencies(producer, int(idle))
            otel = "batchline.tracing._otel" in sys.modules
            answer = {"rps": rps, "p50": harness.percentile(took, 50), "otel": otel}
            print(json.dumps(answer), flush=True)
    finally:
        await producer.aclose()


def _previous(rev: str, dest: Path) -> str:
    """``batchline/`` of ``rev`` under ``dest``; the commit, short."""
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", rev],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "batchline"], capture_output=True, check=True
    ).stdout
    dest.mkdir()
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return commit


def default_previous(repo: Path) -> str:
    """Where ``repo``'s branch left ``main`` (``git merge-base HEAD main``); a SystemExit where
    that is HEAD itself (on ``main``, say), for "previous" would then measure HEAD again."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    base = git("merge-base", "HEAD", "main")
    if base == git("rev-parse", "HEAD"):
        raise SystemExit(
            f"--previous: git merge-base HEAD main is HEAD itself ({base[:7]}): previous would "
            "measure this checkout again; name the version to compare with, --previous REV "
            "(the version before tracing: --previous 3ef3d62)"
        )
    return base


def _start(procs: Procs, url: str, way: str, before: Path) -> dict[str, Any]:
    """A way's worker and producer processes, the worker registered."""
    import redis

    from batchline.keys import QueueKeys

    queue = f"bench-tracing-{way}-{uuid.uuid4().hex[:6]}"
    env = {k: v for k, v in harness.child_env().items() if not k.startswith("OTEL_")}
    if way == "previous":
        env["PYTHONPATH"] = f"{before}:{env['PYTHONPATH']}"
    argv = [sys.executable, "-m", "benchmarks.tracing", "--serve-worker"]
    argv += ["on" if way == "on" else "off", "--log-level", "WARNING", "worker"]
    argv += ["--redis-url", url, "--queue", queue, "--model", "batchline.worker.models:echo"]
    argv += ["--batch-size", "64", "--timeout-ms", "0", "--max-restarts-per-min", "0"]
    worker = procs.spawn(f"worker-{way}", argv, env=env)
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 120
    while not client.zcard(QueueKeys(queue).workers):
        if time.monotonic() > deadline or worker.poll() is not None:
            raise SystemExit(f"the {way} worker did not start:\n" + procs.log_tail(f"worker-{way}"))
        time.sleep(0.1)
    client.close()
    argv = [sys.executable, "-m", "benchmarks.tracing", "--client", url, queue, way]
    producer = procs.spawn(f"producer-{way}", argv, env=env, pipes=True)
    return {"worker": worker, "producer": producer}


def _measure(procs: Procs, ways: dict[str, Any], way: str, n: int, args: Any) -> dict[str, Any]:
    """One measurement of ``way`` (its worker resumed, the others paused)."""
    for other in WAYS:
        (procs.resume if other == way else procs.pause)(f"worker-{other}")
    worker, producer = ways[way]["worker"], ways[way]["producer"]
    meter = CpuMeter({"worker": worker.pid, "producer": producer.pid})
    producer.stdin.write(f"go {n} {args.inflight} {args.idle}\n".encode())
    producer.stdin.flush()
    line = producer.stdout.readline()
    if not line:
        raise SystemExit(f"the {way} producer ended:\n" + procs.log_tail(f"producer-{way}"))
    used = meter.done()
    answer: dict[str, Any] = json.loads(line)
    total = n + args.idle
    answer["worker_us"] = used["worker"] / total * 1e6
    answer["producer_us"] = used["producer"] / total * 1e6
    return answer


def _report(samples: Samples, otel: dict[str, bool], args: Any) -> None:
    print(f"\n{args.repeats} interleaved repeats; medians (range)")
    print(f"{'figure':<24} " + " ".join(f"{w:>26}" for w in WAYS) + "  off/prev  on/off")
    for figure in FIGURES:
        cells = [
            f"{samples.med(f'{w} {figure}') or 0:,.2f} ({samples.spread(f'{w} {figure}')})"
            for w in WAYS
        ]
        off, on, prev = (samples.med(f"{w} {figure}") for w in WAYS)
        ratios = [f"{a / b:.3f}" if a and b else "-" for a, b in ((off, prev), (on, off))]
        print(f"{figure:<24} " + " ".join(f"{c:>26}" for c in cells) + f"  {ratios[0]:>8}"
              f"  {ratios[1]:>6}")  # fmt: skip
    for way in WAYS:
        print(
            f"{way}: the producer imported batchline.tracing._otel: {'yes' if otel[way] else 'no'}"
        )


def _run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        procs = Procs(Path(tmp))
        try:
            commit = _previous(args.previous, Path(tmp) / "previous")
            url, version = harness.start_redis(
                procs, harness.child_env(), harness.redis_binary(args.redis_server)
            )
            print(harness.header())
            print(f"- {harness.machine()}; {version}; previous: {commit}")
            ways = {way: _start(procs, url, way, Path(tmp) / "previous") for way in WAYS}
            samples, otel = Samples(), dict.fromkeys(WAYS, False)
            for way in WAYS:  # warm-up, not counted
                _measure(procs, ways, way, min(2000, args.requests), args)
            for rep in range(args.repeats):
                for way in WAYS[rep % 3 :] + WAYS[: rep % 3]:
                    got = _measure(procs, ways, way, args.requests, args)
                    otel[way] = bool(got["otel"])
                    for figure, key in FIGURES.items():
                        samples.add(f"{way} {figure}", got[key])
                    log(f"repeat {rep + 1} {way}: {got['rps']:,.0f}/s, p50 {got['p50']:.2f} ms,"
                        f" worker {got['worker_us']:.1f} µs/request")  # fmt: skip
            _report(samples, otel, args)
        finally:
            procs.stop_all()


def main() -> int:
    if sys.argv[1:2] == ["--serve-worker"]:
        return _serve_worker(sys.argv[2:])
    if sys.argv[1:2] == ["--client"]:
        asyncio.run(_client(*sys.argv[2:5]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--inflight", type=int, default=500)
    parser.add_argument("--idle", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--previous",
        metavar="REV",
        default="",
        help="the version to compare with (before tracing: 3ef3d62); default: git merge-base "
        "HEAD main, refused where that is HEAD itself",
    )
    harness.add_redis_server_flag(parser)
    args = parser.parse_args()
    args.previous = args.previous or default_previous(REPO)
    _run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
