"""Chaos test of the Redis service: workers killed with SIGKILL, redis-server restarted.

``python -m checks.chaos [--duration 60] [--producers 3] [--workers 3] [--rate 50]``

It starts its own redis-server (free loopback port, AOF ``appendfsync everysec``, a
directory of its own), ``--workers`` worker processes serving ``double`` (x -> 2x) with
``claim_idle_ms`` 1000, and ``--producers`` producer processes, each submitting ``--rate``
requests per second with known expected outputs and waiting for every reply. Every
``--kill-every`` seconds a random worker gets SIGKILL and a new one is started in its place;
once (unless ``--no-redis-restart``) redis-server is stopped (SIGTERM, or SIGKILL with
``--redis-kill``) and started again on the same port and directory, so that it reloads its
AOF. After ``--duration`` seconds the producers stop submitting and wait (at most
``--drain-s``) for what is outstanding; then it prints a summary and exits non-zero if any
accepted request was lost (outside the Redis restart window, see below), answered twice or
answered wrongly.

Hostile inputs: with ``--crash-every N`` every N-th request of each producer is ``"crash"``,
which aborts the worker process that runs it (SIGABRT), and with ``--hang-every N`` it is
``"hang"``, which never returns (the workers run with ``--max-batch-ms``). Each must be
dead-lettered (MaxDeliveries, ``max_deliveries`` 3) while every other request, its batch-mates
included, is answered correctly; the workers' supervisors restart the processes that died.

"Lost in the Redis restart window": with ``appendfsync everysec`` a crashed redis-server may
lose up to about a second of acknowledged writes. A request accepted (its XADD acknowledged)
in the seconds before the restart, never answered, whose entry is in no work stream and which
has no result key, was lost by Redis itself, not by batchline; such requests are counted
apart and do not fail the run. (With SIGTERM redis-server fsyncs its AOF before it exits, so
this count should be 0 there.)
"""

# The parts live beside this file: the redis-server and worker processes in _processes.py,
# the producer processes in _producer.py, the analysis of their reports in _analysis.py.

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from batchline.keys import QueueKeys
from checks.chaos._analysis import WINDOW_AFTER_S, WINDOW_BEFORE_S, analyse
from checks.chaos._processes import REDIS_BINARY, RedisServer, Workers, log
from checks.chaos._producer import producer_main


@dataclass
class _Run:
    """One chaos run: its options, its processes, and what happened to them."""

    args: argparse.Namespace
    rng: random.Random
    workdir: Path
    server: RedisServer
    queue: str
    keys: QueueKeys
    workers: Workers
    procs: list[Any] = field(default_factory=list)  # the producer processes
    redis_window: tuple[float, float] | None = None
    exits: list[tuple[str, int, float]] = field(default_factory=list)  # on their own


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    ap.add_argument("--producers", type=int, default=3)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--rate", type=float, default=50.0, help="requests/s per producer")
    ap.add_argument("--kill-every", type=float, default=3.0, help="seconds between worker kills")
    ap.add_argument("--no-redis-restart", action="store_true")
    ap.add_argument("--redis-kill", action="store_true", help="SIGKILL redis, not SIGTERM")
    ap.add_argument("--redis-down-s", type=float, default=1.0, help="how long Redis stays down")
    ap.add_argument("--drain-s", type=float, default=60.0, help="longest wait for stragglers")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    ap.add_argument("--crash-every", type=int, default=0, help="every N-th request aborts")
    ap.add_argument("--hang-every", type=int, default=0, help="every N-th request hangs")
    ap.add_argument("--max-batch-ms", type=int, default=2000, help="with --hang-every")
    return ap.parse_args(argv)


def _set_up(args: argparse.Namespace) -> _Run:
    """Start redis-server in a fresh work directory; the workers are only described yet."""
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="batchline-chaos-"))
    server = RedisServer(workdir)
    server.start()
    queue = f"chaos-{uuid.uuid4().hex[:8]}"
    hostile = []
    if args.crash_every or args.hang_every:
        hostile = ["--max-deliveries", "3", "--max-batch-ms", str(args.max_batch_ms)]
        hostile += ["--max-restarts-per-min", "1000"]
    workers = Workers(server.url, queue, workdir, heartbeat_s=0.2, hostile=hostile)
    return _Run(args, rng, workdir, server, queue, QueueKeys(queue), workers)


def _start_workers(run: _Run) -> None:
    """Spawn ``--workers`` workers and wait (at most 60 s) until every one is reading."""
    for _ in range(run.args.workers):
        run.workers.spawn()
    admin = redis.Redis(port=run.server.port, socket_timeout=5.0)
    deadline = time.monotonic() + 60
    while admin.zcard(run.keys.workers) < run.args.workers:  # every worker is reading
        if time.monotonic() > deadline:
            raise RuntimeError("workers did not start within 60 s")
        time.sleep(0.05)
    admin.close()


def _start_producers(run: _Run, end_at: float) -> None:
    args = run.args
    ctx = multiprocessing.get_context("spawn")
    for i in range(args.producers):
        p = ctx.Process(
            target=producer_main,
            args=(
                *(i, run.server.url, run.queue, args.rate, end_at, args.drain_s),
                str(run.workdir / f"producer-{i}.json"),
                (args.crash_every, args.hang_every),
            ),
        )
        p.start()
        run.procs.append(p)


def _restart_redis(run: _Run) -> None:
    """Stop redis-server, leave it down ``--redis-down-s``, start it again on its AOF."""
    args = run.args
    down = time.time()
    log(f"stopping redis-server ({'SIGKILL' if args.redis_kill else 'SIGTERM'})")
    run.server.stop(signal.SIGKILL if args.redis_kill else signal.SIGTERM)
    time.sleep(args.redis_down_s)
    run.server.start()
    run.redis_window = (down, time.time())
    log(f"redis-server back after {run.redis_window[1] - down:.2f} s (AOF reloaded)")


def _replace_exited(run: _Run) -> None:
    for wid, rc in run.workers.died():
        # A worker that cannot reach Redis when it starts exits non-zero at once (for
        # its supervisor to restart it): expected only around the Redis restart.
        log(f"worker {wid} exited on its own with {rc}; replacing it")
        run.exits.append((wid, rc, time.time()))
        run.workers.procs.pop(wid)
        run.workers.spawn()


def _kill_loop(run: _Run, start: float, end_at: float) -> None:
    """Until ``end_at``: kill a random worker now and then, restart Redis once."""
    args, rng = run.args, run.rng
    restart_at = None if args.no_redis_restart else start + args.duration * 0.45
    next_kill = time.time() + args.kill_every
    while time.time() < end_at:
        now = time.time()
        if restart_at is not None and now >= restart_at:
            restart_at = None
            _restart_redis(run)
        if now >= next_kill:
            killed = run.workers.kill_one(rng)
            new = run.workers.spawn()
            log(f"SIGKILL {killed}; started {new}")
            next_kill = now + args.kill_every * rng.uniform(0.5, 1.5)
        _replace_exited(run)
        time.sleep(0.05)


def _drain(run: _Run) -> list[dict[str, Any]]:
    """Wait for the producers to finish; the reports they wrote."""
    log("load done; waiting for the producers to drain")
    for p in run.procs:
        p.join(run.args.drain_s + 60)
        if p.is_alive():
            log(f"producer {p.pid} did not finish; killing it")
            p.kill()
            p.join(10)
    parts = []
    for i in range(run.args.producers):
        path = run.workdir / f"producer-{i}.json"
        if path.exists():
            parts.append(json.loads(path.read_text()))
        else:
            log(f"producer {i} wrote no report")
    return parts


def _summarise(run: _Run, parts: list[dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """The producers' reports analysed, with what happened to the workers and to Redis."""
    window = run.redis_window
    died = run.workers.died()
    client = redis.Redis(port=run.server.port, socket_timeout=10.0)
    try:
        summary, ok = analyse(parts, client, run.keys, window)
    finally:
        client.close()
    summary["worker kills"] = run.workers.kills
    summary["worker processes restarted by their supervisor"] = run.workers.restarts()
    run.exits += [(w, rc, time.time()) for w, rc in died]
    unexplained = [
        e for e in run.exits if window is None or not window[0] - 1 <= e[2] <= window[1] + 5
    ]
    explained = len(run.exits) - len(unexplained)
    summary["workers that exited on their own during the Redis restart"] = explained
    summary["workers that exited on their own otherwise"] = len(unexplained)
    if unexplained:
        ok = False
        summary["worker exits (id, rc)"] = [[w, rc] for w, rc, _t in unexplained]
    summary["redis restart"] = "none" if window is None else f"{window[1] - window[0]:.2f} s down"
    if len(parts) != run.args.producers:
        ok = False
        summary["producers without a report"] = run.args.producers - len(parts)
    return summary, ok


def _print_report(summary: dict[str, Any], ok: bool) -> None:
    print("CHAOS SUMMARY " + json.dumps(summary, indent=1, sort_keys=False), flush=True)
    print(
        "note: 'lost in the Redis restart window' = accepted up to "
        f"{WINDOW_BEFORE_S:.0f} s before Redis went down, never answered, and in no work "
        "stream and no result key: Redis (appendfsync everysec) dropped the entry itself. "
        f"'answered twice in the Redis restart window' = first answered up to {WINDOW_AFTER_S:.0f} "
        "s after Redis came back: a write in flight as it went down, made again (its answer "
        "pushed anyway; a producer drops the second)."
    )
    print("CHAOS RESULT " + ("PASS" if ok else "FAIL"), flush=True)


def _tear_down(run: _Run, exit_code: int) -> None:
    for p in run.procs:
        if p.is_alive():
            p.kill()
    run.workers.stop_all()
    run.server.stop()
    if run.args.keep or exit_code != 0:
        log(f"logs kept in {run.workdir}")
    else:
        shutil.rmtree(run.workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if not os.access(REDIS_BINARY, os.X_OK):
        print(f"no redis-server at {REDIS_BINARY}", file=sys.stderr)
        return 2
    run = _set_up(args)
    exit_code = 1
    try:
        log(f"redis on port {run.server.port}, dir {run.workdir}")
        _start_workers(run)
        start = time.time()
        end_at = start + args.duration
        _start_producers(run, end_at)
        _kill_loop(run, start, end_at)
        summary, ok = _summarise(run, _drain(run))
        _print_report(summary, ok)
        exit_code = 0 if ok else 1
    finally:
        _tear_down(run, exit_code)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
