"""The load generators of the queue benchmark's parts (a) and (b), both sides of their pipe.

A child is ``python -m benchmarks.queue`` itself, started again with ``--role`` (``producer``: one batchline
AsyncProducer; ``arq-client``: arq ``enqueue_job`` + ``job.result()``; ``arq-worker``: an arq
worker running the no-op job). A load generator reads commands as JSON lines on its stdin
(``{"op": "run", "n": ..., "inflight": ..., "tag": ...}`` or ``{"op": "quit"}``) and answers
each with one JSON line on its stdout. The parent's side (``spawn_load``, ``drive``,
``quit_loaders``, ``summarise``) is below the children's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks.harness import percentile
from benchmarks.queue._service import Bench

# The children re-run the benchmark, whose main dispatches ``--role`` to ``child_main``.
MODULE = "benchmarks.queue"


# -- child roles (producer, arq client, arq worker) --------------------------------------------


async def noop(ctx: dict[str, Any], x: Any) -> Any:
    """The arq job: the same no-op as batchline's echo model."""
    return x


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


async def closed_loop(
    call: Callable[[str], Awaitable[Any]], n: int, inflight: int, tag: str
) -> dict[str, Any]:
    """``n`` requests, ``inflight`` at a time (each lane sends its next as one returns)."""
    lat_us = [0] * n
    counts = {"errors": 0, "bad": 0}
    first_error: list[str] = []
    numbers = iter(range(n))

    async def lane() -> None:
        for i in numbers:
            value = f"{tag}-{i:08d}"
            t = time.perf_counter()
            try:
                out = await call(value)
            except Exception as exc:
                counts["errors"] += 1
                if not first_error:
                    first_error.append(f"{type(exc).__name__}: {exc}")
                continue
            lat_us[i] = round((time.perf_counter() - t) * 1e6)
            if out != value:
                counts["bad"] += 1

    t0 = time.time()
    p0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(max(1, min(inflight, n)))))
    elapsed = time.perf_counter() - p0
    return {
        "n": n,
        "t0": t0,
        "t1": t0 + elapsed,
        "lat_us": lat_us,
        **counts,
        "first_error": first_error[0] if first_error else "",
    }


async def safe_close(producer: Any, timeout_s: float = 5.0) -> bool:
    """Close an AsyncProducer; True if it closed in time.

    Works around a hang seen with redis-py 8.1 on Python 3.11: a cancelled XREAD can return
    normally (the cancellation is swallowed), and the reply reader (ReplyReader.run) loops on
    ``while True``, so ``aclose()`` waits for its reader forever. Cancelling again frees it.
    """
    task = asyncio.ensure_future(producer.aclose())
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if done:
        task.result()
        return True
    reader = getattr(producer, "_reader", None)
    if reader is not None:
        reader.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
    return False


async def load_role(args: argparse.Namespace) -> None:
    """A load generator (batchline AsyncProducer or arq client), driven by JSON lines."""
    loop = asyncio.get_running_loop()
    extra: dict[str, Any] = {"aclose_hung": 0, "arq_result_not_found": 0}
    close: Callable[[], Awaitable[Any]]
    if args.role == "producer":
        from batchline.producer import AsyncProducer

        producer = AsyncProducer(redis_url=args.redis_url, queue=args.queue, max_queue_depth=0)
        await producer.start()

        async def call(value: str) -> Any:
            return await producer.infer(value)

        async def close() -> None:
            if not await safe_close(producer):
                extra["aclose_hung"] += 1

    else:
        from arq.connections import ArqRedis
        from arq.jobs import ResultNotFound

        # redis-py 8 pools hold 100 connections by default; arq needs one per job in flight.
        pool = ArqRedis(host="127.0.0.1", port=args.port, max_connections=4 * args.inflight + 64)

        async def call(value: str) -> Any:
            job = await pool.enqueue_job("noop", value)
            if job is None:
                raise RuntimeError("arq refused the job (duplicate id)")
            for _ in range(1000):
                try:
                    return await job.result(poll_delay=args.arq_poll_s)
                except ResultNotFound:
                    # arq 0.25 reads the result key and the queue in two round trips: a job
                    # finishing in between looks lost. Poll again (counted in the report).
                    extra["arq_result_not_found"] += 1
                    await asyncio.sleep(args.arq_poll_s)
            raise RuntimeError("arq result not found after 1000 polls")

        close = pool.aclose

    emit({"ready": True, "pid": os.getpid()})
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        result = await closed_loop(call, cmd["n"], cmd["inflight"], cmd["tag"])
        emit({**result, **extra})
    await close()
    emit({"closed": True, **extra})


def arq_worker_role(args: argparse.Namespace) -> None:
    from arq.connections import ArqRedis
    from arq.worker import Worker

    worker = Worker(
        functions=[noop],
        redis_pool=ArqRedis(host="127.0.0.1", port=args.port, max_connections=4 * args.inflight),
        max_jobs=args.inflight,
        poll_delay=args.arq_poll_s,
        keep_result=3600,
        log_results=False,
        handle_signals=True,
    )
    worker.run()


def child_main(args: argparse.Namespace) -> int:
    # Die with the parent, whatever happens to it.
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if args.role == "arq-worker":
        arq_worker_role(args)
    elif args.role == "producer":
        # The producer's loop as batchline worker picks its own (BATCHLINE_EVENT_LOOP).
        from batchline.transport import run_loop

        run_loop(load_role(args), event_loop=os.environ.get("BATCHLINE_EVENT_LOOP", "auto"))
    else:  # arq's client, maybe on a Python of its own (--arq-python): uvloop where it has it
        try:
            import uvloop

            factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
        except ImportError:
            factory = None
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(load_role(args))
    return 0


# -- the parent's side -------------------------------------------------------------------------


Loaders = dict[str, subprocess.Popen[bytes]]


def spawn_load(
    bench: Bench, name: str, role: str, queue: str, inflight: int
) -> subprocess.Popen[bytes]:
    """A load generator (``role`` producer or arq-client), once it says it is ready."""
    argv = bench.python(
        name,
        [
            MODULE,
            "--role", role,
            "--redis-url", bench.url,
            "--port", str(bench.port),
            "--queue", queue,
            "--inflight", str(inflight),
            "--arq-poll-s", str(bench.cfg.arq_poll_s),
        ],
        module=True,
    )  # fmt: skip
    proc = bench.procs.spawn(name, argv, env=bench.env, pipes=True)
    read_line(bench, name, proc)  # {"ready": true}
    return proc


def spawn_arq_worker(bench: Bench) -> int:
    """The arq worker process (its pid), running the no-op job."""
    cfg = bench.cfg
    return bench.procs.spawn(
        "arq-worker",
        bench.python("arq-worker", [
            MODULE, "--role", "arq-worker",
            "--port", str(bench.port), "--inflight", str(cfg.inflight),
            "--arq-poll-s", str(cfg.arq_poll_s),
        ], module=True),
        env=bench.env,
    ).pid  # fmt: skip


def read_line(bench: Bench, name: str, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{name} exited early:\n{bench.procs.log_tail(name)}")
    return dict(json.loads(line))


def drive(bench: Bench, loaders: Loaders, n_each: int, inflight_each: int) -> list[dict[str, Any]]:
    """Each load generator sends ``n_each`` requests, ``inflight_each`` at a time; its replies."""
    tag = uuid.uuid4().hex[:6]
    for proc in loaders.values():
        assert proc.stdin is not None
        cmd = {"op": "run", "n": n_each, "inflight": inflight_each, "tag": tag}
        proc.stdin.write((json.dumps(cmd) + "\n").encode())
        proc.stdin.flush()
    return [read_line(bench, name, proc) for name, proc in loaders.items()]


def quit_loaders(bench: Bench, loaders: Loaders) -> dict[str, int]:
    totals = {"aclose_hung": 0, "arq_result_not_found": 0}
    for name, proc in loaders.items():
        with contextlib.suppress(Exception):
            assert proc.stdin is not None
            proc.stdin.write(b'{"op": "quit"}\n')
            proc.stdin.flush()
            last = read_line(bench, name, proc)
            for k in totals:
                totals[k] = max(totals[k], int(last.get(k, 0)))
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        bench.procs.stop(name)
    return totals


def summarise(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """The load generators' replies to one ``drive``, together."""
    n = sum(r["n"] for r in replies)
    errors = sum(r["errors"] for r in replies)
    bad = sum(r["bad"] for r in replies)
    wall = max(r["t1"] for r in replies) - min(r["t0"] for r in replies)
    lat = sorted(x / 1e3 for r in replies for x in r["lat_us"] if x > 0)
    return {
        "n": n,
        "ok": n - errors - bad,
        "errors": errors,
        "bad": bad,
        "rps": (n - errors) / wall,
        "p50": percentile(lat, 50),
        "p99": percentile(lat, 99),
        "wall": wall,
        "first_error": next((r["first_error"] for r in replies if r["first_error"]), ""),
    }
