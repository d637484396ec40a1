"""``batchline worker``: serve a queue (under a supervising parent unless
``--max-restarts-per-min 0``), or with ``--check`` tell whether a worker of this host is
alive."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from batchline.cli._options import (
    UsageError,
    add_option,
    add_settings,
    field_docs,
    positive,
    read_settings,
)
from batchline.logs import bind as bind_logs

__all__ = ["check_model", "worker_parser", "worker_settings"]


def worker_settings(args: argparse.Namespace) -> Any:
    """The worker's settings, from its parsed ``args`` and the environment (``--serve``,
    given once a queue: its entries joined by ``;``)."""
    from batchline.config import WorkerSettings

    if isinstance(getattr(args, "serve", None), list):
        args.serve = ";".join(args.serve)
    return read_settings(WorkerSettings, args)


def check_model(spec: str, path: str | None, **options: Any) -> None:
    """UsageError if the model settings are wrong in a way seen without loading it (an
    unknown kind, a local path that is not there, options of another backend)."""
    from batchline.worker.models import load_model

    try:
        load_model(spec, path=path, **options)  # made, not loaded
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _worker(args: argparse.Namespace) -> int:
    settings = worker_settings(args)
    if args.check:
        return asyncio.run(_check(settings, args.max_age_s))
    if args.max_age_s is not None:
        raise UsageError("--max-age-s is for --check only")
    for s in settings.served():
        check_model(
            s.model,
            s.model_path,
            backend=s.backend,
            device=s.device,
            calibration=s.calibration,
            deterministic=s.deterministic,
        )
    from batchline.worker._supervisor import report_ready, supervise

    supervised = settings.max_restarts_per_min > 0
    if supervised and args.supervised_child is None:
        # Run the worker in a child process, restarted if it dies.
        return supervise(args.argv, max_restarts_per_min=settings.max_restarts_per_min)
    import signal

    from batchline.errors import ModelNotLoaded, WorkerHung
    from batchline.transport import EXIT_INTERRUPTED, run_loop
    from batchline.worker import Worker
    from batchline.worker._group import WorkerGroup
    from batchline.worker._worker import loading_still
    from batchline.worker.upkeep._watchdog import HUNG_EXIT_CODE

    worker: Worker | WorkerGroup
    if settings.serve is None:
        worker = Worker(settings)
        bind_logs(worker_id=worker.worker_id, queue=worker.keys.queue)
    else:  # several queues: each log line names its worker and queue itself
        worker = WorkerGroup(settings)
    worker.exit_if_loop_blocked = True
    if args.supervised_child is not None:
        report_ready(args.supervised_child, worker.ready)
    if args.bound_file is not None:
        if isinstance(worker, WorkerGroup):
            worker.remember_bounds(Path(args.bound_file))
        else:
            worker.bound_file = Path(args.bound_file)
    try:
        run_loop(worker.run(), event_loop=settings.event_loop)
    except ModelNotLoaded as exc:
        print(f"batchline: {exc}", file=sys.stderr)
        return 1
    except WorkerHung:
        logging.shutdown()
        os._exit(HUNG_EXIT_CODE)  # the hung model's thread cannot be stopped otherwise
    code = EXIT_INTERRUPTED if worker.stop_signal == signal.SIGINT else 0
    if loading_still():  # stopped while its model loaded: the load's thread cannot be stopped
        logging.shutdown()
        os._exit(code)
    return code


async def _check(settings: Any, max_age_s: float | None) -> int:
    """Health check: a worker of this host (or ``worker_id``) sent a heartbeat lately, on
    every queue the settings serve (``serve``: each of its queues)."""
    from batchline.keys import host_id, worker_host
    from batchline.transport import connect
    from batchline.transport.status import LIVE_WITHIN_S

    max_age_s = LIVE_WITHIN_S if max_age_s is None else max_age_s
    client = connect(settings)
    found: list[tuple[Any, list[str]]] = []
    try:
        for served in settings.served():
            since = time.time() - max_age_s
            beats = await client.zrangebyscore(served.keys.workers, since, "+inf")
            found.append((served, [b.decode() for b in beats]))
    except Exception as exc:
        print(f"unhealthy: Redis unreachable ({type(exc).__name__})", file=sys.stderr)
        return 1
    finally:
        await client.aclose()
    healthy = []
    host = host_id()
    for served, names in found:
        # A worker_id names one worker (w1 is not w12); without one, any worker whose id
        # names this host, the whole of its host part (host gpu is not gpu-2).
        if served.worker_id:
            alive = [n for n in names if n == served.worker_id]
            whose = served.worker_id
        else:
            alive = [n for n in names if worker_host(n) == host]
            whose = f"a worker of host {host}"
        if not alive:
            where = f" on queue {served.queue!r}" if settings.serve else ""
            print(
                f"unhealthy: no heartbeat from {whose}{where} within {max_age_s:g} s",
                file=sys.stderr,
            )
            return 1
        healthy += alive
    print(f"healthy: {', '.join(healthy)}")
    return 0


def worker_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``worker`` command to the ``batchline`` parser's subcommands ``sub``."""
    from batchline.config import WorkerSettings
    from batchline.transport.status import LIVE_WITHIN_S

    worker: argparse.ArgumentParser = sub.add_parser(
        "worker",
        help="serve a queue: read requests from Redis, batch them, run the model, answer",
        description="Serve a queue: read requests from Redis, batch them, run the model, "
        "answer; it logs one line starting with 'ready:' once it serves. Each setting is a "
        "flag or a BATCHLINE_<NAME> environment variable (the flag wins). SIGTERM drains "
        "(stop reading, answer what was read) and exits 0; Ctrl-C drains the same way and "
        "exits 130, also while the worker still waits for Redis or loads its model.",
    )
    add_settings(
        worker, WorkerSettings, tuple(n for n in WorkerSettings.model_fields if n != "serve")
    )
    add_option(
        worker,
        "--serve",
        action="append",
        dest="serve",
        default=None,
        metavar="SPEC",
        env="BATCHLINE_SERVE",
        text=field_docs(WorkerSettings)["serve"],
        shown="none",
    )
    add_option(
        worker,
        "--check",
        action="store_true",
        text="health check instead of serving: exit 0 if a worker of this host (its id's "
        "host part this host's, in full; or the one --worker-id names) sent a heartbeat "
        "within --max-age-s, else 1; reads only the Redis, queue and worker_id settings",
    )
    add_option(
        worker,
        "--max-age-s",
        type=positive(float),
        metavar="SECONDS",
        default=None,
        text="with --check: the oldest heartbeat that counts, in seconds",
        shown=f"{LIVE_WITHIN_S:g}",
    )
    worker.add_argument("--supervised-child", type=int, help=argparse.SUPPRESS)
    worker.add_argument("--bound-file", help=argparse.SUPPRESS)
    worker.set_defaults(run=_worker)
    return worker
