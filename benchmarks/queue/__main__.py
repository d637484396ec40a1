"""Queue benchmark: batchline's Redis service end to end, beside arq, on one machine.

One invocation starts its own redis-server (free loopback port, ``--save "" --appendonly no``)
and its own worker and producer processes, and measures:

(a) no-op model (``batchline.worker.models:echo``), one batchline worker process, batch 32,
    timeout_ms 0: end-to-end requests/s and p50/p99 latency, load from ``--producers``
    producer processes (one AsyncProducer each, ``--inflight`` requests in flight in all,
    closed loop, a fixed count of requests); beside arq doing the same no-op as one job per
    request (an arq worker process running ``async def noop(ctx, x): return x``, clients
    ``enqueue_job`` + ``job.result()``, which polls). batchline and arq repeats are
    interleaved; the side not measured is paused with SIGSTOP. arq pins redis < 6: its
    processes can run on a Python of their own (``--arq-python ARQ/bin/python`` after
    ``python -m venv ARQ && ARQ/bin/pip install arq uvloop``); without arq, (a) says so and
    measures batchline alone.
(b) idle latency: one request at a time (sequential submit + wait) on the idle no-op worker,
    over the no-op model's own time.
(c) all-MiniLM-L6-v2 on the CPU, realistic mixed-length sentences (``batchline.demo.sentences``):
    sentences/s served through Redis (one worker, batch 32, timeout_ms 0, all sentences
    submitted at once) vs the offline ceiling ``model.encode(sentences, batch_size=32)`` in this
    process (the worker paused with SIGSTOP, both with the cores available as torch's thread
    count, as a worker picks, unless ``--torch-threads``) vs one sentence at a time through
    Redis (and, for reference, offline).
    Each side first sees every sentence (the worker twice: its length grouping forms other
    batches each pass; each new batch shape is slower the first time); which side runs
    first alternates from repeat to repeat.
(d) all-MiniLM-L6-v2 served through Redis on each CPU backend (``--backend torch`` fp32,
    ``onnx``, ``onnx-int8``, ``openvino``, ``openvino-int8``), interleaved, with the ratio to
    torch and the minimum cosine to torch's embeddings (``_backends.py``; not
    in the default ``--parts abc``: ``--parts d``).
(e) all-MiniLM-L6-v2 with the load generated on this machine at a fixed offered rate
    (open loop, as the demo sends), beside all at once and the offline ceiling of the same
    repeat (``_minilm.py``; ``--parts e``).
(g) the GPU mode: all-MiniLM-L6-v2 at each ``--batch-size`` (default 64,128,256 on cuda),
    served vs the offline ceiling, GPU utilisation while each runs, and whether the worker's
    tokenizing keeps up with its model (``--parts g --device cuda``; runs on a CPU too).

The MiniLM parts (c, e, g) run on ``--device`` (cpu, cuda or auto; default cpu) in
``--dtype`` (auto: the library's, :func:`batchline.devices.pick_dtype`: float16 on cuda,
bfloat16 on a cpu that computes it natively, else float32; the report's header says which) at
``--batch-size`` (c and e: the first). Part (d) runs every backend in float32: its anchor,
torch float32, is float32 by definition.

Every figure is the median of ``--repeats`` repeats (interleaved); ratios are medians of the
per-repeat ratios. The CPU time each process used per request is read from /proc, and the CPU
the rest of the machine used meanwhile is reported as "other load" (the machine is shared).

Usage::

    python -m benchmarks.queue --quick           # smoke run (< 60 s)
    python -m benchmarks.queue --out bench.md    # full run (~3-6 min), 3 repeats
    python -m benchmarks.queue --parts a --profile /tmp/prof   # cProfile worker/producers
    python -m benchmarks.queue --parts d --sentences 1000      # CPU backends vs torch
    python -m benchmarks.queue --parts d --backends torch-deterministic  # the mode's cost
    python -m benchmarks.queue --parts eg --device cuda        # GPU: fp16, batch 64-256

By default the batchline sources are copied to a temporary directory at start and every
process runs that copy, so that edits to the checkout during a run cannot mix versions.
"""

# The parts live beside this file: (a) and (b) in _noop.py (their load generators, this
# module started again with --role, in _roles.py), (c) in _embed.py, (d) in _backends.py,
# (e) and (g) in _minilm.py; the redis-server, workers and settings they share in _service.py,
# the report of (a), (b) and (c) in _report.py.

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    REPO,
    Procs,
    add_redis_server_flag,
    load,
    log,
    provenance,
    redis_binary,
    snapshot,
    watchdog,
)
from benchmarks.queue._backends import BACKENDS, part_d, report_d
from benchmarks.queue._embed import part_c
from benchmarks.queue._minilm import device_of, part_e, part_g, report_e, report_g
from benchmarks.queue._noop import part_ab
from benchmarks.queue._report import report
from benchmarks.queue._roles import child_main
from benchmarks.queue._service import BATCH_SIZE, Bench, Config, Results

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
    minilm_options(p)
    run_options(p)
    role_options(p)
    return p.parse_args(argv)


def minilm_options(p: argparse.ArgumentParser) -> None:
    """The MiniLM parts' (c, d, e, g) options."""
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
        help="dtype of the MiniLM parts c, e, g (auto: the library's: float16 on cuda, "
        "bfloat16 on a cpu that computes it natively, else float32) [auto]",
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
        help=f"(d): the backends compared with torch (deterministic mode off), comma-separated"
        f" [{','.join(BACKENDS)}]; torch-deterministic: torch in deterministic mode",
    )


def run_options(p: argparse.ArgumentParser) -> None:
    """The counts of parts (a), (b) and (c), the workers' extra settings, how the run goes."""
    p.add_argument("--requests", type=int, help="batchline requests per repeat (a) [60000]")
    p.add_argument("--arq-requests", type=int, help="arq jobs per repeat (a) [6000]")
    p.add_argument("--producers", type=int, default=1, help="producer processes (a) [1]")
    p.add_argument("--inflight", type=int, default=1000, help="requests in flight, all (a)")
    p.add_argument("--arq-poll-s", type=float, default=0.05, help="arq poll delays [0.05]")
    p.add_argument(
        "--arq-python",
        default=sys.executable,
        metavar="PATH",
        help="the Python that runs arq's worker and clients (a) [this one]: arq pins redis < 6, "
        "so it may live in a virtual environment of its own",
    )
    p.add_argument("--idle-requests", type=int, help="sequential requests (b) [500]")
    p.add_argument("--sentences", type=int, help="sentences served and encoded (c) [3000]")
    p.add_argument("--sequential", type=int, help="sentences one at a time (c) [200]")
    add_redis_server_flag(p)
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


def role_options(p: argparse.ArgumentParser) -> None:
    """The child roles' options (internal, not in --help)."""
    p.add_argument(
        "--role", choices=["producer", "arq-client", "arq-worker"], help=argparse.SUPPRESS
    )
    p.add_argument("--redis-url", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--queue", help=argparse.SUPPRESS)


def _program(name: str) -> str:
    """A program named on the command line as its children can start it: a path made
    absolute (they run in the run's log folder; not resolved: a virtual environment's
    ``bin/python`` is a link that must stay itself), a bare name as found on PATH."""
    if os.sep in name:
        return os.path.abspath(name)
    return shutil.which(name) or name


def config(args: argparse.Namespace) -> Config:
    q = args.quick

    def pick(value: int | None, full: int, quick: int) -> int:
        return value if value is not None else (quick if q else full)

    server = redis_binary(args.redis_server)
    cfg = Config(
        quick=q,
        repeats=pick(args.repeats, 3, 1),
        parts="".join(sorted(set(args.parts) & set("abcdeg"))),
        requests=pick(args.requests, 60_000, 4_000),
        arq_requests=pick(args.arq_requests, 6_000, 400),
        producers=max(1, args.producers),
        inflight=max(1, args.inflight),
        arq_poll_s=args.arq_poll_s,
        arq_python=_program(args.arq_python),
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
    """The event loop the children pick (BATCHLINE_EVENT_LOOP, batchline.transport._event_loop)."""
    from batchline.transport import loop_factory

    name = os.environ.get("BATCHLINE_EVENT_LOOP", "auto")
    factory = loop_factory(name)
    return f"{factory.__module__.split('.')[0]} (BATCHLINE_EVENT_LOOP={name})"


@contextlib.contextmanager
def sources(live: bool) -> Iterator[Path]:
    """A copy of batchline/ (or the checkout itself with ``live``), first on sys.path."""
    if live:
        sys.path.insert(0, str(REPO))
        yield REPO
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-queue-src-"))
    try:
        yield snapshot(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.role:
        return child_main(args)
    cfg = config(args)
    prepare(cfg)
    logdir = Path(tempfile.mkdtemp(prefix="bench-queue-"))
    procs = Procs(logdir)
    res = Results()
    res.info["load_before"] = load()

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    watchdog(
        args.max_seconds or (120.0 if cfg.quick else 1800.0), "benchmarks.queue", procs.stop_all
    )
    started = time.perf_counter()
    run(args, cfg, procs, res)
    res.info["load_after"] = load()
    text = full_report(res, cfg, argv)
    print(text)
    if args.out:
        args.out.write_text(text)
    log(f"done in {time.perf_counter() - started:.0f} s")
    return 0


def prepare(cfg: Config) -> None:
    """This process's settings, before torch loads."""
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


def run(args: argparse.Namespace, cfg: Config, procs: Procs, res: Results) -> None:
    """Every part asked for, on one redis-server; the processes' logs are kept on failure."""
    failed = False
    try:
        with sources(args.no_snapshot) as src:
            res.info["provenance"] = provenance(src, copy_of=REPO)
            res.info["loop"] = loop_in_use()
            if cfg.device == "auto" and not args.batch_size:
                cfg.batch_sizes = [64, 128, 256] if device_of(cfg) == "cuda" else [BATCH_SIZE]
            bench = Bench(cfg, procs, src, res)
            bench.start_redis()
            log(f"{res.info['redis']} on port {bench.port}; logs in {procs.logdir}")
            if "a" in cfg.parts or "b" in cfg.parts:
                part_ab(bench)
            if "c" in cfg.parts:
                part_c(bench)
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
            shutil.rmtree(procs.logdir, ignore_errors=True)
        else:
            log(f"process logs kept in {procs.logdir}")


def full_report(res: Results, cfg: Config, argv: list[str]) -> str:
    """The table of (a), (b) and (c), then the tables of (d), (e) and (g)."""
    text = report(res, cfg, argv)
    if "d" in cfg.parts:
        text += "\n".join(report_d(res, cfg, cfg.backends)) + "\n"
    if "e" in cfg.parts:
        text += "\n".join(report_e(res, cfg)) + "\n"
    if "g" in cfg.parts:
        text += "\n".join(report_g(res, cfg)) + "\n"
    return text


if __name__ == "__main__":
    sys.exit(main())
