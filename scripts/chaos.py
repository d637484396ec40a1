"""Chaos test of the Redis service: workers killed with SIGKILL, redis-server restarted.

``python scripts/chaos.py [--duration 60] [--producers 3] [--workers 3] [--rate 50]``

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

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from batchline.keys import QueueKeys  # noqa: E402

MODEL = "tests.service.models_for_tests:double"
HOSTILE_MODEL = "tests.service.models_for_tests:double_or_die"
POISON = ("crash", "hang")
REDIS_BINARY = os.environ.get("BLTEST_REDIS_SERVER", "/usr/bin/redis-server")
# A request accepted this long before Redis went down may be lost by Redis (fsync every s).
WINDOW_BEFORE_S = 2.0


def _log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_ready(port: int) -> bool:
    """True once the server answers PING and has finished loading its data."""
    try:
        client = redis.Redis(port=port, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            return bool(client.ping()) and int(client.info("persistence")["loading"]) == 0
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        self.dir = workdir / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 30.0) -> None:
        with open(self.dir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *(REDIS_BINARY, "--port", str(self.port), "--bind", "127.0.0.1"),
                    *("--save", "", "--appendonly", "yes", "--appendfsync", "everysec"),
                    *("--dir", str(self.dir)),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        while not _redis_ready(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"redis-server did not start; log:\n{(self.dir / 'redis.log').read_text()}"
                )
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout_s)


class Workers:
    def __init__(
        self, url: str, queue: str, workdir: Path, heartbeat_s: float, hostile: list[str]
    ) -> None:
        self.url, self.queue, self.workdir, self.heartbeat_s = url, queue, workdir, heartbeat_s
        self.hostile = hostile  # extra worker flags when hostile inputs are sent
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.all: list[subprocess.Popen[bytes]] = []
        self.kills = 0
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLINE_")}
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO)] + ([self.env["PYTHONPATH"]] if self.env.get("PYTHONPATH") else [])
        )
        self.env["PYTHONUNBUFFERED"] = "1"

    def spawn(self) -> str:
        wid = f"chaos-w{len(self.all)}-{uuid.uuid4().hex[:6]}"
        args = [sys.executable, "-m", "batchline", "worker", "--redis-url", self.url]
        model = HOSTILE_MODEL if self.hostile else MODEL
        args += ["--queue", self.queue, "--model", model, "--worker-id", wid]
        args += ["--claim-idle-ms", "1000", "--max-deliveries", "10", *self.hostile]
        args += ["--heartbeat-s", str(self.heartbeat_s), "--batch-size", "16"]
        with open(self.workdir / f"worker-{wid}.log", "wb") as log:
            proc = subprocess.Popen(
                args, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )
        self.procs[wid] = proc
        self.all.append(proc)
        return wid

    def kill_one(self, rng: random.Random) -> str:
        wid = rng.choice(sorted(self.procs))
        proc = self.procs.pop(wid)
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        self.kills += 1
        return wid

    def restarts(self) -> int:
        """Worker processes their supervisors replaced (after a crash or a hang)."""
        logs = self.workdir.glob("worker-*.log")
        return sum(p.read_text(errors="replace").count("; restarting in") for p in logs)

    def died(self) -> list[tuple[str, int]]:
        """Workers that exited on their own (none should)."""
        return [(w, p.returncode) for w, p in self.procs.items() if p.poll() is not None]

    def stop_all(self) -> None:
        for proc in self.all:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.all:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


# -- producer processes ----------------------------------------------------------------------


def producer_main(
    idx: int,
    url: str,
    queue: str,
    rate: float,
    end_at: float,
    drain_s: float,
    out: str,
    poison_every: tuple[int, int],
) -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)
    asyncio.run(_produce(idx, url, queue, rate, end_at, drain_s, Path(out), poison_every))


def _value(idx: int, i: int, poison_every: tuple[int, int]) -> Any:
    """The i-th value of producer idx: a number, or a poison input every N-th request."""
    for kind, every in zip(POISON, poison_every, strict=True):
        if every and i % every == every - 1:
            return kind
    return idx * 1_000_000_000 + i


async def _produce(
    idx: int,
    url: str,
    queue: str,
    rate: float,
    end_at: float,
    drain_s: float,
    out: Path,
    poison_every: tuple[int, int] = (0, 0),
) -> None:
    from batchline.producer import AsyncProducer

    accepted: dict[str, list[Any]] = {}  # rid -> [value, accepted at (unix s)]
    submit_failed: dict[str, str] = {}  # rid -> exception type
    results: dict[str, list[Any]] = {}  # rid -> [status, output, etype, how]
    replies: Counter[str] = Counter()  # raw replies seen by the reply readers
    first_reply_at: dict[str, float] = {}
    producers: list[Any] = []
    tasks: list[asyncio.Task[None]] = []
    restarts = 0

    async def new_producer() -> Any:
        producer = AsyncProducer(redis_url=url, queue=queue)
        # Count raw replies where they arrive: the public API settles each request once and
        # drops a second reply for it silently.
        deliver = producer._replies.deliver

        def counting(raw: dict[Any, Any]) -> None:
            rid: str = raw.get(b"id", b"?").decode(errors="replace")
            replies[rid] += 1
            first_reply_at.setdefault(rid, time.time())
            deliver(raw)

        # A patched method: mypy refuses assigning to one (method-assign) and compares the
        # function with the unbound method, self included (assignment).
        producer._replies.deliver = counting  # type: ignore[method-assign, assignment]
        await producer.start()
        producers.append(producer)
        return producer

    async def waiter(producer: Any, handle: Any) -> None:
        try:
            r = await producer.wait(handle, timeout_s=max(1.0, end_at + drain_s - time.time()))
            results[handle.id] = [r.status, r.output, r.error_type, "reply"]
        except Exception as exc:  # RequestTimeout, BatcherClosed: decided at the end
            _ = exc

    producer = await new_producer()
    consecutive_failures = 0
    period = 1.0 / rate
    next_at = time.monotonic()
    i = 0
    while time.time() < end_at:
        value = _value(idx, i, poison_every)
        rid = f"p{idx}-{i}"
        i += 1
        try:
            async with asyncio.timeout(5.0):
                handle = await producer.submit(value, request_id=rid)
        except Exception as exc:  # Redis down: ConnectionError, BusyLoadingError, timeout
            submit_failed[rid] = type(exc).__name__
            consecutive_failures += 1
            if consecutive_failures >= 5:
                # Keep the old producer open: its reader reconnects and still settles what it
                # accepted. New requests go through a fresh producer (new connection pool and
                # reply stream), as an application restarting its client would do.
                producer = await new_producer()
                restarts += 1
                consecutive_failures = 0
            await asyncio.sleep(0.1)
            next_at = time.monotonic()
            continue
        consecutive_failures = 0
        accepted[rid] = [value, time.time()]
        tasks.append(asyncio.create_task(waiter(producer, handle)))
        next_at += period
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    if tasks:
        await asyncio.wait(tasks, timeout=max(1.0, end_at + drain_s - time.time() + 5))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # What no reply settled (e.g. sent to a producer whose reader had gone): the result key.
    client = redis.Redis.from_url(url)
    keys = QueueKeys(queue)
    try:
        for rid in accepted:
            if rid in results:
                continue
            with contextlib.suppress(redis.RedisError, OSError):
                raw = client.get(keys.result(rid))
                if raw is not None:
                    from batchline.codec import Limits, unpack_result

                    r = unpack_result(raw, Limits())
                    results[rid] = [r.status, r.output, r.error_type, "result-key"]
    finally:
        client.close()
    for p in producers:
        with contextlib.suppress(Exception):
            await p.aclose()
    out.write_text(  # noqa: ASYNC240 - once, at the very end
        json.dumps(
            {
                "accepted": accepted,
                "submit_failed": submit_failed,
                "results": results,
                "replies": dict(replies),
                "first_reply_at": first_reply_at,
                "restarts": restarts,
            }
        )
    )


# -- analysis --------------------------------------------------------------------------------


def _in_streams(client: redis.Redis, keys: QueueKeys) -> set[str]:
    ids: set[str] = set()
    for stream in keys.streams:
        for _entry, fields in client.xrange(stream) or []:
            rid = (fields or {}).get(b"id", b"")
            ids.add(rid.decode(errors="replace") if isinstance(rid, bytes) else rid)
    return ids


def analyse(
    parts: list[dict[str, Any]],
    client: redis.Redis,
    keys: QueueKeys,
    redis_window: tuple[float, float] | None,
) -> tuple[dict[str, Any], bool]:
    accepted: dict[str, list[Any]] = {}
    results: dict[str, list[Any]] = {}
    submit_failed: Counter[str] = Counter()
    replies: Counter[str] = Counter()
    first_reply_at: dict[str, float] = {}
    restarts = 0
    for part in parts:
        accepted.update(part["accepted"])
        results.update(part["results"])
        submit_failed.update(part["submit_failed"].values())
        replies.update(part["replies"])
        first_reply_at.update(part["first_reply_at"])
        restarts += part["restarts"]
    correct = 0
    poison_dead = 0
    errors: Counter[str] = Counter()
    wrong: list[Any] = []
    lost: list[str] = []
    lost_window: list[str] = []
    in_streams = _in_streams(client, keys)
    for rid, (value, at) in accepted.items():
        r = results.get(rid)
        if r is None:
            present = rid in in_streams or bool(client.exists(keys.result(rid)))
            if (
                redis_window is not None
                and not present
                and redis_window[0] - WINDOW_BEFORE_S <= at <= redis_window[1]
            ):
                lost_window.append(rid)
            else:
                lost.append(rid)
            continue
        status, output, etype, _how = r
        if value in POISON:
            if (status, etype) == ("error", "MaxDeliveries"):
                poison_dead += 1
            else:
                wrong.append([rid, value, [status, etype]])
        elif status == "ok":
            if output == 2 * value:
                correct += 1
            else:
                wrong.append([rid, value, output])
        else:
            errors[f"{status}:{etype}" if etype else status] += 1
    twice = {rid: n for rid, n in replies.items() if n > 1 and rid in accepted}
    twice_window = {
        rid: n
        for rid, n in twice.items()
        if redis_window is not None
        and redis_window[0] - WINDOW_BEFORE_S <= first_reply_at.get(rid, 0) <= redis_window[1]
    }
    strangers = sorted(set(replies) - set(accepted))
    summary = {
        "sent": len(accepted) + sum(submit_failed.values()),
        "accepted": len(accepted),
        "refused at submit (Redis down), by type": dict(submit_failed),
        "answered correctly": correct,
        "poison inputs accepted": sum(1 for v, _at in accepted.values() if v in POISON),
        "poison inputs dead-lettered": poison_dead,
        "errored, by type": dict(errors),
        "answered via result key (not reply)": sum(
            1 for r in results.values() if r[3] == "result-key"
        ),
        "lost": len(lost),
        "lost in the Redis restart window": len(lost_window),
        "answered twice": len(twice) - len(twice_window),
        "answered twice in the Redis restart window": len(twice_window),
        "wrong results": len(wrong),
        "replies for requests whose submit failed": len(strangers),
        "producer restarts": restarts,
    }
    if lost:
        summary["lost ids (first 20)"] = lost[:20]
    if wrong:
        summary["wrong (first 20)"] = wrong[:20]
    if twice:
        summary["twice (first 20)"] = dict(list(twice.items())[:20])
    ok = not lost and not wrong and len(twice) == len(twice_window)
    return summary, ok


# -- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
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
    args = ap.parse_args(argv)
    if not os.access(REDIS_BINARY, os.X_OK):
        print(f"no redis-server at {REDIS_BINARY}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="batchline-chaos-"))
    server = RedisServer(workdir)
    server.start()
    queue = f"chaos-{uuid.uuid4().hex[:8]}"
    keys = QueueKeys(queue)
    hostile = []
    if args.crash_every or args.hang_every:
        hostile = ["--max-deliveries", "3", "--max-batch-ms", str(args.max_batch_ms)]
        hostile += ["--max-restarts-per-min", "1000"]
    workers = Workers(server.url, queue, workdir, heartbeat_s=0.2, hostile=hostile)
    ctx = multiprocessing.get_context("spawn")
    procs: list[Any] = []
    redis_window: tuple[float, float] | None = None
    exits: list[tuple[str, int, float]] = []  # workers that exited on their own
    exit_code = 1
    try:
        _log(f"redis on port {server.port}, dir {workdir}")
        for _ in range(args.workers):
            workers.spawn()
        admin = redis.Redis(port=server.port, socket_timeout=5.0)
        deadline = time.monotonic() + 60
        while admin.zcard(keys.workers) < args.workers:  # every worker is reading
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not start within 60 s")
            time.sleep(0.05)
        admin.close()
        start = time.time()
        end_at = start + args.duration
        for i in range(args.producers):
            p = ctx.Process(
                target=producer_main,
                args=(
                    *(i, server.url, queue, args.rate, end_at, args.drain_s),
                    str(workdir / f"producer-{i}.json"),
                    (args.crash_every, args.hang_every),
                ),
            )
            p.start()
            procs.append(p)
        restart_at = None if args.no_redis_restart else start + args.duration * 0.45
        next_kill = time.time() + args.kill_every
        while time.time() < end_at:
            now = time.time()
            if restart_at is not None and now >= restart_at:
                restart_at = None
                down = time.time()
                _log(f"stopping redis-server ({'SIGKILL' if args.redis_kill else 'SIGTERM'})")
                server.stop(signal.SIGKILL if args.redis_kill else signal.SIGTERM)
                time.sleep(args.redis_down_s)
                server.start()
                redis_window = (down, time.time())
                _log(f"redis-server back after {redis_window[1] - down:.2f} s (AOF reloaded)")
            if now >= next_kill:
                killed = workers.kill_one(rng)
                new = workers.spawn()
                _log(f"SIGKILL {killed}; started {new}")
                next_kill = now + args.kill_every * rng.uniform(0.5, 1.5)
            for wid, rc in workers.died():
                # A worker that cannot reach Redis when it starts exits non-zero at once (for
                # its supervisor to restart it): expected only around the Redis restart.
                _log(f"worker {wid} exited on its own with {rc}; replacing it")
                exits.append((wid, rc, time.time()))
                workers.procs.pop(wid)
                workers.spawn()
            time.sleep(0.05)
        _log("load done; waiting for the producers to drain")
        for p in procs:
            p.join(args.drain_s + 60)
            if p.is_alive():
                _log(f"producer {p.pid} did not finish; killing it")
                p.kill()
                p.join(10)
        parts = []
        for i in range(args.producers):
            path = workdir / f"producer-{i}.json"
            if path.exists():
                parts.append(json.loads(path.read_text()))
            else:
                _log(f"producer {i} wrote no report")
        died = workers.died()
        client = redis.Redis(port=server.port, socket_timeout=10.0)
        try:
            summary, ok = analyse(parts, client, keys, redis_window)
        finally:
            client.close()
        summary["worker kills"] = workers.kills
        summary["worker processes restarted by their supervisor"] = workers.restarts()
        exits += [(w, rc, time.time()) for w, rc in died]
        unexplained = [
            e
            for e in exits
            if redis_window is None or not redis_window[0] - 1 <= e[2] <= redis_window[1] + 5
        ]
        summary["workers that exited on their own during the Redis restart"] = len(exits) - len(
            unexplained
        )
        summary["workers that exited on their own otherwise"] = len(unexplained)
        if unexplained:
            ok = False
            summary["worker exits (id, rc)"] = [[w, rc] for w, rc, _t in unexplained]
        summary["redis restart"] = (
            "none" if redis_window is None else f"{redis_window[1] - redis_window[0]:.2f} s down"
        )
        if len(parts) != args.producers:
            ok = False
            summary["producers without a report"] = args.producers - len(parts)
        print("CHAOS SUMMARY " + json.dumps(summary, indent=1, sort_keys=False), flush=True)
        print(
            "note: 'lost in the Redis restart window' = accepted up to "
            f"{WINDOW_BEFORE_S:.0f} s before Redis went down, never answered, and in no work "
            "stream and no result key: Redis (appendfsync everysec) dropped the entry itself."
        )
        print("CHAOS RESULT " + ("PASS" if ok else "FAIL"), flush=True)
        exit_code = 0 if ok else 1
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        workers.stop_all()
        server.stop()
        if args.keep or exit_code != 0:
            _log(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
