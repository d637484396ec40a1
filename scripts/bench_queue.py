"""Queue benchmark: batchline's Redis service end to end, beside arq, on one machine.

One invocation starts its own redis-server (free loopback port, ``--save "" --appendonly no``)
and its own worker and producer processes, and measures:

(a) no-op model (``batchline.worker.models:echo``), one batchline worker process, batch 32,
    timeout_ms 0: end-to-end requests/s and p50/p99 latency, load from ``--producers``
    producer processes (one AsyncProducer each, ``--inflight`` requests in flight in all,
    closed loop, a fixed count of requests); beside arq doing the same no-op as one job per
    request (an arq worker process running ``async def noop(ctx, x): return x``, clients
    ``enqueue_job`` + ``job.result()``, which polls). batchline and arq repeats are
    interleaved; the side not measured is paused with SIGSTOP.
(b) idle latency: one request at a time (sequential submit + wait) on the idle no-op worker,
    over the no-op model's own time.
(c) all-MiniLM-L6-v2 on the CPU, realistic mixed-length sentences (``batchline.demo.sentences``):
    sentences/s served through Redis (one worker, batch 32, timeout_ms 0, all sentences
    submitted at once) vs the offline ceiling ``model.encode(sentences, batch_size=32)`` in this
    process (the worker paused with SIGSTOP, both with torch's default thread count unless
    ``--torch-threads``) vs one sentence at a time through Redis (and, for reference, offline).
    Both sides first see every sentence once (each new batch shape is slower the first time).
(d) all-MiniLM-L6-v2 served through Redis on each CPU backend (``--backend torch`` fp32,
    ``onnx``, ``onnx-int8``, ``openvino``, ``openvino-int8``), interleaved, with the ratio to
    torch and the minimum cosine to torch's embeddings (``scripts/_bench_backends.py``; not
    in the default ``--parts abc``: ``--parts d``).
(e) all-MiniLM-L6-v2 with the load generated on this machine at a fixed offered rate
    (open loop, as the demo sends), beside all at once and the offline ceiling of the same
    repeat (``scripts/_bench_minilm.py``; ``--parts e``).
(g) the GPU mode: all-MiniLM-L6-v2 at each ``--batch-size`` (default 64,128,256 on cuda),
    served vs the offline ceiling, GPU utilisation while each runs, and whether the worker's
    tokenizing keeps up with its model (``--parts g --device cuda``; runs on a CPU too).

The MiniLM parts (c, e, g) run on ``--device`` (cpu, cuda or auto; default cpu) in
``--dtype`` (auto: float16 on cuda, float32 on cpu) at ``--batch-size`` (c and e: the first).

Every figure is the median of ``--repeats`` repeats (interleaved); ratios are medians of the
per-repeat ratios. The CPU time each process used per request is read from /proc, and the CPU
the rest of the machine used meanwhile is reported as "other load" (the machine is shared).

Usage::

    python scripts/bench_queue.py --quick           # smoke run (< 60 s)
    python scripts/bench_queue.py --out bench.md    # full run (~3-6 min), 3 repeats
    python scripts/bench_queue.py --parts a --profile /tmp/prof   # cProfile worker/producers
    python scripts/bench_queue.py --parts d --sentences 1000      # CPU backends vs torch
    python scripts/bench_queue.py --parts eg --device cuda        # GPU: fp16, batch 64-256

By default the batchline sources are copied to a temporary directory at start and every
process runs that copy, so that edits to the checkout during a run cannot mix versions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _bench_backends import BACKENDS, part_d, report_d
from _bench_minilm import (
    ceiling_model,
    device_of,
    part_e,
    part_g,
    report_e,
    report_g,
    where,
    worker_flags,
)
from _harness import (
    REPO,
    CpuMeter,
    Procs,
    Samples,
    fmt,
    free_port,
    load,
    log,
    machine,
    percentile,
    provenance,
    versions,
    watchdog,
)

BATCH_SIZE = 32

DISTS = (
    "redis",
    "hiredis",
    "uvloop",
    "arq",
    "torch",
    "sentence-transformers",
    "onnxruntime",
    "openvino",
)

TARGETS = {
    "a_rps": 20_000.0,  # batchline end-to-end requests/s, no-op model
    "a_vs_arq": 10.0,  # batchline / arq
    "b_p50_ms": 1.5,  # idle latency over the model's own time
    "b_p99_ms": 5.0,
    "c_vs_ceiling": 0.90,  # served / offline encode
    "c_vs_sequential": 2.5,  # served / one at a time
}


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
        functions=[noop],  # type: ignore[list-item]
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
    else:
        from batchline.transport._loop import run

        # The producer's loop as batchline worker picks its own (BATCHLINE_EVENT_LOOP).
        run(load_role(args), event_loop=os.environ.get("BATCHLINE_EVENT_LOOP", "auto"))
    return 0


# -- processes ---------------------------------------------------------------------------------


# -- the run -----------------------------------------------------------------------------------


@dataclass
class Config:
    quick: bool
    repeats: int
    parts: str
    requests: int
    arq_requests: int
    producers: int
    inflight: int
    arq_poll_s: float
    idle_requests: int
    sentences: int
    sequential: int
    redis_server: str
    profile: Path | None
    torch_threads: int
    worker_args: list[str]
    backends: list[str] = field(default_factory=lambda: list(BACKENDS))
    device: str = "cpu"
    dtype: str = "auto"
    batch_sizes: list[int] = field(default_factory=lambda: [BATCH_SIZE])
    prep: int = 1
    offered_rate: float = 0.0


@dataclass
class Results(Samples):
    notes: list[str] = field(default_factory=list)
    info: dict[str, str] = field(default_factory=dict)


class Bench:
    def __init__(self, cfg: Config, procs: Procs, src: Path, res: Results) -> None:
        self.cfg = cfg
        self.procs = procs
        self.src = src
        self.res = res
        self.env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1"}
        if cfg.torch_threads:
            self.env["OMP_NUM_THREADS"] = str(cfg.torch_threads)
        self.env.pop("PYTHONSTARTUP", None)
        self.port = 0
        self.url = ""
        self.admin: Any = None

    # -- infrastructure ------------------------------------------------------------------------

    def start_redis(self) -> None:
        import redis

        for _attempt in range(5):
            port = free_port()
            proc = self.procs.spawn(
                "redis-server",
                [
                    self.cfg.redis_server,
                    "--port", str(port),
                    "--bind", "127.0.0.1",
                    "--save", "",
                    "--appendonly", "no",
                    "--daemonize", "no",
                    "--maxclients", "10000",
                    "--dir", str(self.procs.logdir),
                ],
                env=self.env,
            )  # fmt: skip
            client = redis.Redis(host="127.0.0.1", port=port)
            for _ in range(100):
                if proc.poll() is not None:
                    break
                try:
                    client.ping()
                    self.port, self.url, self.admin = port, f"redis://127.0.0.1:{port}/0", client
                    version = client.info("server")["redis_version"]
                    self.res.info["redis"] = f"redis-server {version} ({self.cfg.redis_server})"
                    return
                except redis.ConnectionError:
                    time.sleep(0.05)
            self.procs.stop("redis-server")
        raise RuntimeError("could not start redis-server:\n" + self.procs.log_tail("redis-server"))

    def python(self, name: str, args: list[str], *, module: bool = False) -> list[str]:
        """argv of a Python child, under cProfile when --profile is given for it."""
        prof = self.cfg.profile
        head = [sys.executable]
        if prof is not None and name.startswith(("bl-", "noop-worker")):
            head += ["-m", "cProfile", "-o", str(prof / f"{name}.prof")]
        return [*head, *(["-m"] if module else []), *args]

    def spawn_worker(
        self, name: str, queue: str, model: str, *extra: str, batch_size: int = BATCH_SIZE
    ) -> tuple[int, str]:
        proc = self.procs.spawn(
            name,
            self.python(
                name,
                [
                    "batchline",
                    "--log-level", "WARNING",
                    "worker",
                    "--redis-url", self.url,
                    "--queue", queue,
                    "--model", model,
                    "--batch-size", str(batch_size),
                    "--timeout-ms", "0",
                    "--heartbeat-s", "0.5",
                    # No supervisor: the pid paused, measured and matched is the worker's.
                    "--max-restarts-per-min", "0",
                    *extra,
                ],
                module=True,
            ),
            env=self.env,
        )  # fmt: skip
        from batchline.keys import QueueKeys

        keys = QueueKeys(queue)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}:\n{self.procs.log_tail(name)}")
            for member in self.admin.zrange(keys.workers, 0, -1):
                wid = member.decode()
                if f"-{proc.pid}-" in wid and self.admin.exists(keys.worker_stats(wid)):
                    return proc.pid, wid
            time.sleep(0.1)
        raise RuntimeError(f"{name} not ready after 180 s:\n{self.procs.log_tail(name)}")

    def worker_stats(self, queue: str, wid: str, newer_than: float = 0.0) -> dict[str, Any]:
        from batchline.keys import QueueKeys

        key = QueueKeys(queue).worker_stats(wid)
        deadline = time.monotonic() + 5
        while True:
            raw = self.admin.get(key)
            stats = json.loads(raw) if raw else {}
            if stats.get("time", 0) > newer_than or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    @staticmethod
    def batch_delta(before: dict[str, Any], after: dict[str, Any]) -> float | None:
        h0 = before.get("batch_size_histogram", {})
        h1 = after.get("batch_size_histogram", {})
        batches = items = 0
        for size, count in h1.items():
            d = count - h0.get(size, 0)
            batches += d
            items += int(size) * d
        return items / batches if batches else None

    def unlink(self, pattern: str) -> None:
        batch: list[bytes] = []
        for key in self.admin.scan_iter(match=pattern, count=5000):
            batch.append(key)
            if len(batch) >= 5000:
                self.admin.unlink(*batch)
                batch.clear()
        if batch:
            self.admin.unlink(*batch)

    def spawn_load(
        self, name: str, role: str, queue: str, inflight: int
    ) -> subprocess.Popen[bytes]:
        argv = self.python(
            name,
            [
                str(Path(__file__).resolve()),
                "--role", role,
                "--redis-url", self.url,
                "--port", str(self.port),
                "--queue", queue,
                "--inflight", str(inflight),
                "--arq-poll-s", str(self.cfg.arq_poll_s),
            ],
        )  # fmt: skip
        proc = self.procs.spawn(name, argv, env=self.env, pipes=True)
        self.read_line(name, proc)  # {"ready": true}
        return proc

    def read_line(self, name: str, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{name} exited early:\n{self.procs.log_tail(name)}")
        return dict(json.loads(line))

    def drive(
        self, loaders: dict[str, subprocess.Popen[bytes]], n_each: int, inflight_each: int
    ) -> list[dict[str, Any]]:
        tag = uuid.uuid4().hex[:6]
        for proc in loaders.values():
            assert proc.stdin is not None
            cmd = {"op": "run", "n": n_each, "inflight": inflight_each, "tag": tag}
            proc.stdin.write((json.dumps(cmd) + "\n").encode())
            proc.stdin.flush()
        return [self.read_line(name, proc) for name, proc in loaders.items()]

    def quit_loaders(self, loaders: dict[str, subprocess.Popen[bytes]]) -> dict[str, int]:
        totals = {"aclose_hung": 0, "arq_result_not_found": 0}
        for name, proc in loaders.items():
            with contextlib.suppress(Exception):
                assert proc.stdin is not None
                proc.stdin.write(b'{"op": "quit"}\n')
                proc.stdin.flush()
                last = self.read_line(name, proc)
                for k in totals:
                    totals[k] = max(totals[k], int(last.get(k, 0)))
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            self.procs.stop(name)
        return totals

    @staticmethod
    def summarise(replies: list[dict[str, Any]]) -> dict[str, float]:
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

    # -- (a) and (b): the no-op model ----------------------------------------------------------

    def part_ab(self) -> None:
        cfg, res = self.cfg, self.res
        k = cfg.producers
        each_inflight = max(1, cfg.inflight // k)
        queue = "bench-noop"
        wpid, wid = self.spawn_worker("noop-worker", queue, "batchline.worker.models:echo")
        bl = {
            f"bl-producer-{i}": self.spawn_load(
                f"bl-producer-{i}", "producer", queue, each_inflight
            )
            for i in range(k)
        }
        arq: dict[str, subprocess.Popen[bytes]] = {}
        arq_pid = 0
        has_arq = importlib.util.find_spec("arq") is not None
        if "a" in cfg.parts and not has_arq:
            res.notes.append(
                "arq is not installed (pip install 'batchline[bench]'; it pins redis < 6): "
                "the arq comparison is left out"
            )
        if "a" in cfg.parts and has_arq:
            arq_pid = self.procs.spawn(
                "arq-worker",
                self.python("arq-worker", [
                    str(Path(__file__).resolve()), "--role", "arq-worker",
                    "--port", str(self.port), "--inflight", str(cfg.inflight),
                    "--arq-poll-s", str(cfg.arq_poll_s),
                ]),
                env=self.env,
            ).pid  # fmt: skip
            arq = {
                f"arq-client-{i}": self.spawn_load(
                    f"arq-client-{i}", "arq-client", queue, each_inflight
                )
                for i in range(k)
            }
        log(f"(a/b) worker {wid}; {k} producer(s), {each_inflight} in flight each")
        # warm-up (imports, connections, scripts, JIT-less caches)
        self.drive(bl, min(2000, cfg.requests // k), each_inflight)
        if arq:
            self.drive(arq, min(200, cfg.arq_requests // k), each_inflight)
            self.procs.pause("arq-worker")
        self.unlink(f"batchline:{{{queue}}}:res:*")
        self.unlink("arq:result:*")

        for rep in range(cfg.repeats):
            if "a" in cfg.parts:
                pids = {
                    "worker": wpid,
                    "redis": self.procs.procs["redis-server"].pid,
                    "_bench": os.getpid(),
                }
                pids |= {name: p.pid for name, p in bl.items()}
                before = self.worker_stats(queue, wid)
                meter = CpuMeter(pids)
                replies = self.drive(bl, cfg.requests // k, each_inflight)
                cpu = meter.done()
                s = self.summarise(replies)
                after = self.worker_stats(queue, wid, newer_than=time.time())
                self.record_cpu("a_bl", cpu, s["n"], bl)
                res.add("a_bl_rps", s["rps"])
                res.add("a_bl_p50", s["p50"])
                res.add("a_bl_p99", s["p99"])
                res.add("a_bl_batch", self.batch_delta(before, after))
                res.add("a_bl_failed", s["errors"] + s["bad"])
                if s["errors"] or s["bad"]:
                    res.notes.append(
                        f"(a) batchline repeat {rep + 1}: {s['errors']} errors, "
                        f"{s['bad']} wrong outputs; {s['first_error']}"
                    )
                log(
                    f"(a) batchline #{rep + 1}: {s['rps']:,.0f} req/s, p50 {s['p50']:.1f} ms, "
                    f"p99 {s['p99']:.1f} ms, sent {s['n']:,}, ok {s['ok']:,}, "
                    f"batch {res.rows['a_bl_batch'][-1] if res.rows.get('a_bl_batch') else 0:.1f}"
                    f", other load {cpu['_other_cores']:.2f} cores"
                )
                self.unlink(f"batchline:{{{queue}}}:res:*")

                if arq:
                    self.procs.pause("noop-worker")
                    self.procs.resume("arq-worker")
                    pids = {
                        "worker": arq_pid,
                        "redis": self.procs.procs["redis-server"].pid,
                        "_bench": os.getpid(),
                    }
                    pids |= {name: p.pid for name, p in arq.items()}
                    meter = CpuMeter(pids)
                    a = self.summarise(self.drive(arq, cfg.arq_requests // k, each_inflight))
                    cpu = meter.done()
                    self.procs.pause("arq-worker")
                    self.procs.resume("noop-worker")
                    self.record_cpu("a_arq", cpu, a["n"], arq)
                    res.add("a_arq_rps", a["rps"])
                    res.add("a_arq_p50", a["p50"])
                    res.add("a_arq_p99", a["p99"])
                    res.add("a_arq_failed", a["errors"] + a["bad"])
                    res.add("a_ratio", s["rps"] / a["rps"])
                    if a["errors"] or a["bad"]:
                        res.notes.append(
                            f"(a) arq repeat {rep + 1}: {a['errors']} errors, "
                            f"{a['bad']} wrong outputs; {a['first_error']}"
                        )
                    log(
                        f"(a) arq       #{rep + 1}: {a['rps']:,.0f} req/s, p50 {a['p50']:.1f} "
                        f"ms, p99 {a['p99']:.1f} ms, sent {a['n']:,}; other load "
                        f"{cpu['_other_cores']:.2f} cores"
                    )
                    self.unlink("arq:result:*")
                    self.unlink("arq:job:*")

            if "b" in cfg.parts:
                self.part_b(queue, wpid, rep)

        hung = self.quit_loaders(bl)
        arq_counts = self.quit_loaders(arq) if arq else {}
        if hung["aclose_hung"]:
            res.notes.append(
                f"AsyncProducer.aclose() hung in {hung['aclose_hung']} producer "
                "process(es) (redis-py swallowed the reply reader's cancellation); "
                "worked around by cancelling it again"
            )
        if arq_counts.get("arq_result_not_found"):
            res.info["arq_retries"] = str(arq_counts["arq_result_not_found"])
        if arq:
            # arq's worker sometimes ignores SIGTERM (its main task's cancellation is lost
            # the same way as the producer's, above): it is killed after 5 s then.
            res.info["arq_worker_exit"] = str(self.procs.stop("arq-worker", timeout_s=5.0))
        rc = self.procs.stop("noop-worker")
        res.info["noop_worker_exit"] = str(rc)

    def record_cpu(
        self, prefix: str, cpu: dict[str, float], n: int, loaders: dict[str, Any]
    ) -> None:
        res = self.res
        res.add(f"{prefix}_cpu_worker_us", cpu["worker"] / n * 1e6)
        res.add(f"{prefix}_cpu_redis_us", cpu["redis"] / n * 1e6)
        res.add(f"{prefix}_cpu_producers_us", sum(cpu[name] for name in loaders) / n * 1e6)
        res.add(
            f"{prefix}_cpu_cores",
            sum(v for k, v in cpu.items() if not k.startswith("_")) / cpu["_wall"],
        )
        res.add(f"{prefix}_other_cores", cpu["_other_cores"])

    def part_b(self, queue: str, wpid: int, rep: int) -> None:
        from batchline.producer import AsyncProducer
        from batchline.worker.models import echo

        cfg, res = self.cfg, self.res
        # The model's own time: the no-op batch function on one item, in process.
        item = ["x" * 24]
        t = time.perf_counter()
        for _ in range(10000):
            echo(item)
        model_ms = (time.perf_counter() - t) / 10000 * 1e3

        async def run() -> tuple[list[float], list[float], list[float], list[float], bool]:
            producer = AsyncProducer(redis_url=self.url, queue=queue, max_queue_depth=0)
            await producer.start()
            lat: list[float] = []
            gapped: list[float] = []
            worker_model: list[float] = []
            queue_ms: list[float] = []
            try:
                # back to back (the target), then with a 2 ms pause before each request (the
                # processes go to sleep in between, as on a quiet service)
                for gap in (0.0, 0.002):
                    for i in range(20 + cfg.idle_requests):
                        if gap:
                            await asyncio.sleep(gap)
                        value = f"idle-{i:06d}-xxxxxxxxxxxx"
                        t0 = time.perf_counter()
                        result = await producer.wait(await producer.submit(value), timeout_s=10)
                        dt = (time.perf_counter() - t0) * 1e3
                        if result.output != value:
                            raise RuntimeError(f"idle request {i}: {result}")
                        if i < 20:  # the first 20 warm up
                            continue
                        if gap:
                            gapped.append(dt)
                        else:
                            lat.append(dt)
                            worker_model.append(result.model_ms)
                            queue_ms.append(result.queue_ms)
            finally:
                closed = await safe_close(producer)
            return lat, gapped, worker_model, queue_ms, closed

        meter = CpuMeter(
            {"worker": wpid, "bench": os.getpid(), "redis": self.procs.procs["redis-server"].pid}
        )
        lat, gapped, worker_model, queue_ms, closed = asyncio.run(run())
        other = meter.done()["_other_cores"]
        over = sorted(x - model_ms for x in lat)
        gapped = sorted(x - model_ms for x in gapped)
        res.add("b_p50", percentile(over, 50))
        res.add("b_p99", percentile(over, 99))
        res.add("b_gap_p50", percentile(gapped, 50))
        res.add("b_gap_p99", percentile(gapped, 99))
        res.add("b_mean", statistics.fmean(over))
        res.add("b_worker_model_ms", statistics.median(worker_model))
        res.add("b_queue_ms", statistics.median(queue_ms))
        res.add("b_model_own_us", model_ms * 1e3)
        res.add("b_other_cores", other)
        if not closed:
            res.notes.append(f"(b) repeat {rep + 1}: AsyncProducer.aclose() hung (worked around)")
        log(
            f"(b) idle      #{rep + 1}: p50 {percentile(over, 50):.3f} ms, p99 "
            f"{percentile(over, 99):.3f} ms over the model's {model_ms * 1e3:.2f} us "
            f"({len(lat)} sequential requests; with 2 ms pauses p50 "
            f"{percentile(gapped, 50):.3f}, p99 {percentile(gapped, 99):.3f} ms; "
            f"other load {other:.2f} cores)"
        )

    # -- (c): all-MiniLM-L6-v2 ----------------------------------------------------------------

    def part_c(self) -> None:
        from batchline.demo.sentences import sentences
        from batchline.producer import AsyncProducer

        cfg, res = self.cfg, self.res
        texts = sentences(cfg.sentences, seed=7)
        words = [len(t.split()) for t in texts]
        res.info["sentences"] = (
            f"{len(texts)} sentences, {min(words)}-{max(words)} words "
            f"(mean {statistics.fmean(words):.1f}), seed 7"
        )
        queue, size = "bench-embed", cfg.batch_sizes[0]
        log(f"(c) starting the all-MiniLM-L6-v2 worker ({where(cfg)}, batch {size}) ...")
        wpid, wid = self.spawn_worker(
            "embed-worker",
            queue,
            "sentence-transformers",
            *worker_flags(cfg),
            *cfg.worker_args,
            batch_size=size,
        )
        threads = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        ).stdout.strip()

        async def through_redis(values: list[str], at_once: bool) -> tuple[float, list[Any]]:
            producer = AsyncProducer(redis_url=self.url, queue=queue, max_queue_depth=0)
            await producer.start()
            try:
                t = time.perf_counter()
                if at_once:
                    outs = await producer.map(values, timeout_s=600)
                else:
                    outs = [await producer.infer(v, timeout_s=60) for v in values]
                return time.perf_counter() - t, outs
            finally:
                await safe_close(producer)

        # Warm-up with every sentence once: each new (batch, length) shape is slower the first
        # time, on both sides.
        asyncio.run(through_redis(texts, True))
        log("(c) loading the model in this process for the offline ceiling ...")
        import numpy as np
        import torch

        self.procs.pause("embed-worker")
        model = ceiling_model(cfg)
        model.encode(texts, batch_size=size)  # warm-up, every shape once
        self.procs.resume("embed-worker")
        res.info["torch_threads"] = (
            f"torch {torch.__version__}: {torch.get_num_threads()} "
            f"threads in this process (ceiling), {threads} in a fresh "
            "process with the worker's environment"
            + (
                f" (--torch-threads {cfg.torch_threads})"
                if cfg.torch_threads
                else " (the cores available, as a worker picks)"
            )
            + f", OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')} on both sides"
        )
        for rep in range(cfg.repeats):
            before = self.worker_stats(queue, wid)
            meter = CpuMeter(
                {
                    "worker": wpid,
                    "bench": os.getpid(),
                    "redis": self.procs.procs["redis-server"].pid,
                }
            )
            elapsed, served = asyncio.run(through_redis(texts, True))
            cpu = meter.done()
            after = self.worker_stats(queue, wid, newer_than=time.time())
            served_rate = len(texts) / elapsed
            batch = self.batch_delta(before, after)

            seq_texts = texts[: cfg.sequential]
            seq_elapsed, _ = asyncio.run(through_redis(seq_texts, False))
            seq_rate = len(seq_texts) / seq_elapsed

            self.procs.pause("embed-worker")
            try:
                meter2 = CpuMeter({"bench": os.getpid()})
                t = time.perf_counter()
                offline = model.encode(texts, batch_size=size)
                ceiling_rate = len(texts) / (time.perf_counter() - t)
                cpu2 = meter2.done()
                # what batching can gain on this CPU at all: the same model, one at a time
                t = time.perf_counter()
                for text in seq_texts:
                    model.encode([text], batch_size=1)
                offline_seq_rate = len(seq_texts) / (time.perf_counter() - t)
            finally:
                self.procs.resume("embed-worker")
            diff = float(np.max(np.abs(np.stack(served) - offline.astype(np.float32))))
            res.add("c_served", served_rate)
            res.add("c_ceiling", ceiling_rate)
            res.add("c_sequential", seq_rate)
            res.add("c_offline_seq", offline_seq_rate)
            res.add("c_offline_gain", ceiling_rate / offline_seq_rate)
            res.add("c_vs_ceiling", served_rate / ceiling_rate)
            res.add("c_vs_sequential", served_rate / seq_rate)
            res.add("c_batch", batch)
            res.add("c_maxdiff", diff)
            res.add("c_worker_cores", cpu["worker"] / cpu["_wall"])
            res.add("c_io_cores", (cpu["bench"] + cpu["redis"]) / cpu["_wall"])
            res.add("c_ceiling_cores", cpu2["bench"] / cpu2["_wall"])
            res.add("c_other_served", cpu["_other_cores"])
            res.add("c_other_ceiling", cpu2["_other_cores"])
            log(
                f"(c) embed     #{rep + 1}: served {served_rate:,.1f}/s (batch {batch or 0:.1f})"
                f", ceiling {ceiling_rate:,.1f}/s, one at a time {seq_rate:,.1f}/s (offline "
                f"{offline_seq_rate:,.1f}/s); max |diff| "
                f"{diff:.1e}; other load {cpu['_other_cores']:.2f}/{cpu2['_other_cores']:.2f}"
            )
        rc = self.procs.stop("embed-worker")
        res.info["embed_worker_exit"] = str(rc)


# -- report ------------------------------------------------------------------------------------


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def report(res: Results, cfg: Config, argv: list[str]) -> str:
    m = res.med
    t = TARGETS
    lines = [
        "## batchline queue benchmark (Redis service, end to end)",
        "",
        f"Command: `python scripts/bench_queue.py {' '.join(argv)}`  ",
        f"Machine: {machine(res.info.get('load_before', '?'), res.info.get('load_after', '?'))}"
        "; shared with other users.  ",
        f"Measured: {res.info.get('provenance', '?')}  ",
        f"{versions(*DISTS)}; {res.info.get('redis', '')}  ",
        f"Event loop of the worker and producer processes: {res.info.get('loop', '?')}  ",
        f"Medians of {cfg.repeats} interleaved repeat(s); ratios are medians of per-repeat "
        "ratios; the range of the repeats is in brackets.",
    ]
    if set(cfg.parts) & set("abc"):  # the parts of this table (d, e, g have their own)
        lines += [
            "",
            "| Measure | batchline | reference | ratio | target | result |",
            "|---|---:|---:|---:|---|---|",
        ]

    def cell(key: str, digits: int = 0, unit: str = "") -> str:
        spread = res.spread(key)
        return fmt(m(key), digits, unit) + (f" [{spread}]" if spread else "")

    def ok(key: str, target: float, higher: bool = True) -> bool | None:
        v = m(key)
        return None if v is None else (v >= target if higher else v <= target)

    if "a" in cfg.parts:
        both = None
        if m("a_bl_rps") is not None and m("a_ratio") is not None:
            both = bool(ok("a_bl_rps", t["a_rps"])) and bool(ok("a_ratio", t["a_vs_arq"]))
        lines += [
            f"| (a) no-op, end to end, req/s ({cfg.requests:,} requests; {cfg.producers} "
            f"producer process(es), {cfg.inflight} in flight) | {cell('a_bl_rps')} | arq "
            f"{cell('a_arq_rps')} ({cfg.arq_requests:,} jobs) | {cell('a_ratio', 1, 'x')} | "
            f">= {t['a_rps']:,.0f} req/s and >= {t['a_vs_arq']:.0f}x arq | {verdict(both)} |",
            f"| (a) latency under that load, p50 / p99 (ms) | {fmt(m('a_bl_p50'), 1)} / "
            f"{fmt(m('a_bl_p99'), 1)} | arq {fmt(m('a_arq_p50'), 1)} / {fmt(m('a_arq_p99'), 1)} "
            "| | | |",
        ]
    if "b" in cfg.parts:
        lines += [
            f"| (b) idle latency over the model's own time, p50 (ms; {cfg.idle_requests} "
            f"sequential requests) | {cell('b_p50', 3)} | | | <= {t['b_p50_ms']} ms | "
            f"{verdict(ok('b_p50', t['b_p50_ms'], higher=False))} |",
            f"| (b) idle latency, p99 (ms) | {cell('b_p99', 3)} | | | <= {t['b_p99_ms']} ms | "
            f"{verdict(ok('b_p99', t['b_p99_ms'], higher=False))} |",
        ]
    if "c" in cfg.parts:
        lines += [
            f"| (c) all-MiniLM-L6-v2, served through Redis vs offline `encode`, sentences/s "
            f"({cfg.sentences:,} sentences; {where(cfg)}, batch {cfg.batch_sizes[0]}) | {cell('c_served', 1)} | ceiling "
            f"{cell('c_ceiling', 1)} | {cell('c_vs_ceiling', 2)} | >= {t['c_vs_ceiling']:.2f} "
            f"| {verdict(ok('c_vs_ceiling', t['c_vs_ceiling']))} |",
            f"| (c) served vs one sentence at a time through Redis ({cfg.sequential} "
            f"sequential), sentences/s | {cell('c_served', 1)} | one at a time "
            f"{cell('c_sequential', 1)} | {cell('c_vs_sequential', 2, 'x')} | "
            f">= {t['c_vs_sequential']}x | {verdict(ok('c_vs_sequential', t['c_vs_sequential']))} |",
        ]
    lines += ["", "Details (medians):" if set(cfg.parts) & set("abc") else "Details:", ""]
    parts = [m(f"a_bl_cpu_{x}_us") for x in ("worker", "producers", "redis")]
    cpu_total = sum(x for x in parts if x is not None)
    arq_parts = [m(f"a_arq_cpu_{x}_us") for x in ("worker", "producers", "redis")]
    arq_total = sum(x for x in arq_parts if x is not None)
    if "a" in cfg.parts:
        lines += [
            f"- (a) batchline mean batch size {fmt(m('a_bl_batch'), 1)}; CPU per request: "
            f"worker {fmt(m('a_bl_cpu_worker_us'))} us, producers "
            f"{fmt(m('a_bl_cpu_producers_us'))} us, redis-server {fmt(m('a_bl_cpu_redis_us'))} "
            f"us; our processes kept {fmt(m('a_bl_cpu_cores'), 2)} cores busy, other users "
            f"{fmt(m('a_bl_other_cores'), 2)} cores; failed requests "
            f"{fmt(m('a_bl_failed'))}. All CPU per request together: "
            f"{fmt(cpu_total, 0)} us, i.e. at most {fmt(2e6 / cpu_total if cpu_total else None)}"
            " req/s on 2 free cores.",
            f"- (a) arq: CPU per request worker {fmt(m('a_arq_cpu_worker_us'))} us, clients "
            f"{fmt(m('a_arq_cpu_producers_us'))} us, redis-server "
            f"{fmt(m('a_arq_cpu_redis_us'))} us, together {fmt(arq_total)} us "
            f"({fmt(arq_total / cpu_total if cpu_total and arq_total else None, 1)}x batchline's"
            f"; a load-independent comparison); other users "
            f"{fmt(m('a_arq_other_cores'), 2)} cores; failed {fmt(m('a_arq_failed'))}. Settings: max_jobs {cfg.inflight}, "
            f"worker poll_delay and job.result(poll_delay) {cfg.arq_poll_s} s, connection pools "
            "sized for the jobs in flight; ResultNotFound (an arq 0.25 race between its two "
            f"reads) retried {res.info.get('arq_retries', '0')} times.",
        ]
    if "b" in cfg.parts:
        lines += [
            f"- (b) mean {fmt(m('b_mean'), 3)} ms; with a 2 ms pause before each request "
            f"(processes asleep in between) p50 {fmt(m('b_gap_p50'), 3)} ms, p99 "
            f"{fmt(m('b_gap_p99'), 3)} ms; the no-op's own time "
            f"{fmt(m('b_model_own_us'), 2)} us (subtracted); as the worker reports it: "
            f"queue_ms p50 {fmt(m('b_queue_ms'), 3)}, model_ms p50 "
            f"{fmt(m('b_worker_model_ms'), 3)} (batch start to its answer); other users "
            f"{fmt(m('b_other_cores'), 2)} cores.",
        ]
    if "c" in cfg.parts:
        lines += [
            f"- (c) {res.info.get('sentences', '')}; mean batch size {fmt(m('c_batch'), 1)}; "
            f"worker used {fmt(m('c_worker_cores'), 2)} cores while serving (redis-server and "
            f"the producer {fmt(m('c_io_cores'), 2)}), the ceiling "
            f"{fmt(m('c_ceiling_cores'), 2)}; served vs offline embeddings max |diff| "
            f"{fmt(m('c_maxdiff'), 7)}; {res.info.get('torch_threads', '')}. Offline, one "
            f"sentence at a time: {fmt(m('c_offline_seq'), 1)}/s, so batching gains at most "
            f"{fmt(m('c_offline_gain'), 2)}x on this CPU (ceiling / offline one at a time).",
        ]

    def series(key: str, digits: int = 0) -> str:
        return ", ".join(fmt(v, digits) for v in res.rows.get(key, []))

    if "a" in cfg.parts:
        lines.append(
            f"- (a) per repeat: batchline req/s {series('a_bl_rps')} (other users "
            f"{series('a_bl_other_cores', 2)} cores); arq req/s {series('a_arq_rps')} "
            f"(other users {series('a_arq_other_cores', 2)} cores)."
        )
    if "b" in cfg.parts:
        lines.append(
            f"- (b) per repeat: p50 {series('b_p50', 3)} ms, p99 {series('b_p99', 3)}"
            f" ms (other users {series('b_other_cores', 2)} cores)."
        )
    if "c" in cfg.parts:
        lines.append(
            f"- (c) per repeat: served {series('c_served', 1)} (other users "
            f"{series('c_other_served', 2)} cores); ceiling {series('c_ceiling', 1)} "
            f"(other users {series('c_other_ceiling', 2)} cores); one at a time through "
            f"Redis {series('c_sequential', 1)}; offline one at a time "
            f"{series('c_offline_seq', 1)} sentences/s."
        )
    exits = [
        f"{k.split('_')[0]} worker exit code {v}"
        for k, v in res.info.items()
        if k.endswith("_worker_exit")
    ]
    if exits:
        lines.append(f"- SIGTERM: {', '.join(exits)}.")
    lines += [f"- Note: {note}" for note in res.notes]
    return "\n".join(lines) + "\n"


# -- main --------------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smoke run, tiny counts (< 60 s)")
    p.add_argument("--repeats", type=int, default=None, help="repeats (default 3; quick 1)")
    p.add_argument("--out", type=Path, help="also write the markdown table to this file")
    p.add_argument(
        "--parts", default="abc", help="which parts to run: any of a, b, c, d, e, g [abc]"
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda", "auto"],
        help="device of the MiniLM parts c, e, g (auto: cuda when present) [cpu]",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="dtype of the MiniLM parts (auto: float16 on cuda, float32 on cpu) [auto]",
    )
    p.add_argument(
        "--batch-size",
        help="MiniLM batch size(s), comma-separated: (g) runs each, (c) and (e) the first "
        "[32 on cpu, 64,128,256 on cuda]",
    )
    p.add_argument(
        "--prep-threads", type=int, default=1, help="the MiniLM workers' prep_threads [1]"
    )
    p.add_argument(
        "--offered-rate",
        type=float,
        default=0.0,
        help="(e): requests/s offered [1.25x the offline ceiling measured in the same repeat]",
    )
    p.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help=f"(d): the backends compared with torch, comma-separated [{','.join(BACKENDS)}]",
    )
    p.add_argument("--requests", type=int, help="batchline requests per repeat (a) [60000]")
    p.add_argument("--arq-requests", type=int, help="arq jobs per repeat (a) [6000]")
    p.add_argument("--producers", type=int, default=1, help="producer processes (a) [1]")
    p.add_argument("--inflight", type=int, default=1000, help="requests in flight, all (a)")
    p.add_argument("--arq-poll-s", type=float, default=0.05, help="arq poll delays [0.05]")
    p.add_argument("--idle-requests", type=int, help="sequential requests (b) [500]")
    p.add_argument("--sentences", type=int, help="sentences served and encoded (c) [3000]")
    p.add_argument("--sequential", type=int, help="sentences one at a time (c) [200]")
    p.add_argument("--redis-server", default=None, help="redis-server binary")
    p.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the (c) and (d) workers, e.g. --worker-arg=--read-ahead=16",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch threads of the MiniLM workers and ceilings alike (default: the cores "
        "available, as a worker picks)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        help="run (a)'s worker and producers under cProfile, writing DIR/<process>.prof",
    )
    p.add_argument(
        "--no-snapshot",
        action="store_true",
        help="run the checkout's batchline/ live instead of a copy taken at start",
    )
    p.add_argument("--max-seconds", type=float, help="abort (and clean up) after this long")
    # child roles (internal)
    p.add_argument(
        "--role", choices=["producer", "arq-client", "arq-worker"], help=argparse.SUPPRESS
    )
    p.add_argument("--redis-url", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--queue", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> Config:
    q = args.quick

    def pick(value: int | None, full: int, quick: int) -> int:
        return value if value is not None else (quick if q else full)

    server = args.redis_server or (
        "/usr/bin/redis-server"
        if Path("/usr/bin/redis-server").exists()
        else shutil.which("redis-server") or "redis-server"
    )
    cfg = Config(
        quick=q,
        repeats=pick(args.repeats, 3, 1),
        parts="".join(sorted(set(args.parts) & set("abcdeg"))),
        requests=pick(args.requests, 60_000, 4_000),
        arq_requests=pick(args.arq_requests, 6_000, 400),
        producers=max(1, args.producers),
        inflight=max(1, args.inflight),
        arq_poll_s=args.arq_poll_s,
        idle_requests=pick(args.idle_requests, 500, 50),
        sentences=pick(args.sentences, 3000, 192),
        sequential=pick(args.sequential, 200, 16),
        redis_server=server,
        profile=args.profile,
        torch_threads=max(0, args.torch_threads),
        worker_args=list(args.worker_arg),
        backends=[b for b in args.backends.split(",") if b],
        device=args.device,
        dtype=args.dtype,
        batch_sizes=[int(b) for b in (args.batch_size or "").split(",") if b],
        prep=max(1, args.prep_threads),
        offered_rate=max(0.0, args.offered_rate),
    )
    if not cfg.batch_sizes:  # auto is resolved once the snapshot is importable
        cfg.batch_sizes = [64, 128, 256] if cfg.device == "cuda" else [BATCH_SIZE]
    return cfg


def loop_in_use() -> str:
    """The event loop the children pick (BATCHLINE_EVENT_LOOP, batchline.transport._loop)."""
    from batchline.transport._loop import loop_factory

    name = os.environ.get("BATCHLINE_EVENT_LOOP", "auto")
    factory = loop_factory(name)
    return f"{factory.__module__.split('.')[0]} (BATCHLINE_EVENT_LOOP={name})"


@contextlib.contextmanager
def snapshot(live: bool) -> Iterator[Path]:
    """A copy of batchline/ (or the checkout itself with ``live``), first on sys.path."""
    if live:
        sys.path.insert(0, str(REPO))
        yield REPO
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-queue-src-"))
    try:
        shutil.copytree(
            REPO / "batchline", tmp / "batchline", ignore=shutil.ignore_patterns("__pycache__")
        )
        sys.path.insert(0, str(tmp))
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.role:
        return child_main(args)
    cfg = config(args)
    # The offline ceilings run in this process with a worker's CPU threading (passive OpenMP
    # waits; torch's thread count is the cores available, as a worker's), set before torch
    # loads: the same engine settings on both sides, so that the ratio measures the service,
    # not torch's spinning threads on a shared machine.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if cfg.torch_threads:
        os.environ["OMP_NUM_THREADS"] = str(cfg.torch_threads)
    if cfg.profile is not None:
        cfg.profile.mkdir(parents=True, exist_ok=True)
        cfg.profile = cfg.profile.resolve()
    logdir = Path(tempfile.mkdtemp(prefix="bench-queue-"))
    procs = Procs(logdir)
    res = Results()
    res.info["load_before"] = load()

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    watchdog(args.max_seconds or (120.0 if cfg.quick else 1800.0), "bench_queue", procs.stop_all)
    failed = False
    started = time.perf_counter()
    try:
        with snapshot(args.no_snapshot) as src:
            res.info["provenance"] = provenance(src)
            res.info["loop"] = loop_in_use()
            if cfg.device == "auto" and not args.batch_size:
                cfg.batch_sizes = [64, 128, 256] if device_of(cfg) == "cuda" else [BATCH_SIZE]
            bench = Bench(cfg, procs, src, res)
            bench.start_redis()
            log(f"{res.info['redis']} on port {bench.port}; logs in {logdir}")
            if "a" in cfg.parts or "b" in cfg.parts:
                bench.part_ab()
            if "c" in cfg.parts:
                bench.part_c()
            if "d" in cfg.parts:
                part_d(bench, cfg.backends)
            if "e" in cfg.parts:
                part_e(bench)
            if "g" in cfg.parts:
                part_g(bench)
    except BaseException as exc:
        failed = True
        if not isinstance(exc, KeyboardInterrupt | SystemExit):
            log(f"FAILED: {type(exc).__name__}: {exc}")
        raise
    finally:
        procs.stop_all()
        if not failed:
            shutil.rmtree(logdir, ignore_errors=True)
        else:
            log(f"process logs kept in {logdir}")
    res.info["load_after"] = load()
    text = report(res, cfg, argv)
    if "d" in cfg.parts:
        text += "\n".join(report_d(res, cfg, cfg.backends)) + "\n"
    if "e" in cfg.parts:
        text += "\n".join(report_e(res, cfg)) + "\n"
    if "g" in cfg.parts:
        text += "\n".join(report_g(res, cfg)) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    log(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
