"""In-process benchmark: batchline vs batched 0.1.5 vs fast-dynamic-batcher 1.1.0 vs none.

Everything runs in ONE process invocation on one machine, so the figures are comparable with
each other (and only with each other). What is measured:

1. throughput (items/s): 64 threads calling the thread APIs, 1000 asyncio tasks calling the
   aio APIs; a fixed number of items per cell, each cell repeated ``--repeats`` times (the
   repeats are interleaved across implementations) and the median reported;
2. mean batch size of each batcher (its own stats; counted in the function for
   fast-dynamic-batcher, whose function runs in another process);
3. share of the ideal throughput of the model-like function, the ideal being measured in the
   same run: the function called back to back on full batches of 32, no batcher;
4. single-caller latency (one caller, sequential calls) on an idle batcher at timeout_ms 5
   and 0, as the latency added over the no-op function's own time;
5. idle CPU: one call, then the process's CPU time over ~2 s of idleness, in % of one core.

The latency and idle-CPU cells are repeated ``--repeats`` times too, each repeat's cells in
an order rotated from the last one's, and report the medians of their repeats.

Functions: ``noop`` returns its input list; ``model`` sleeps 2 ms + 50 us per item (a stand-in
for a model whose cost is mostly fixed per batch) and returns its inputs.

Usage::

    python -m benchmarks.inprocess            # full run (~3-5 min)
    python -m benchmarks.inprocess --quick    # smoke run (< 30 s)
    python -m benchmarks.inprocess --out bench.md --repeats 5

fast-dynamic-batcher runs its model in a spawned process, which imports its models by name
from ``_batchers.py``: keep everything that runs under ``main()``.
"""

# The parts live beside this file: the batch functions, batchers and results in _batchers.py
# (fast-dynamic-batcher's spawned process imports it for its models), throughput in
# _throughput.py, latency and idle CPU in _latency.py, the report in _report.py.

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.harness import load, log, provenance, watchdog
from benchmarks.inprocess._batchers import Results
from benchmarks.inprocess._latency import run_idle_cpu, run_latency
from benchmarks.inprocess._report import report
from benchmarks.inprocess._throughput import (
    IDEAL_BATCHES,
    QUICK_DIVISOR,
    ideal_rate,
    run_throughput,
)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny counts (< 30 s)")
    parser.add_argument(
        "--repeats", type=int, help="repeats of every cell, interleaved (medians) [3; quick 1]"
    )
    parser.add_argument("--out", type=Path, help="also write the markdown report to this file")
    parser.add_argument(
        "--only",
        choices=["throughput", "latency", "idle"],
        action="append",
        help="run only these parts (repeatable; default: all)",
    )
    parser.add_argument("--max-seconds", type=float, default=None, help="abort after this long")
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    args.scale = QUICK_DIVISOR if args.quick else 1
    args.latency_calls = 30 if args.quick else 300
    args.idle_seconds = 0.5 if args.quick else 2.0
    watchdog(args.max_seconds or (120 if args.quick else 900), "benchmarks.inprocess")
    parts = set(args.only or ["throughput", "latency", "idle"])

    res = Results(load_before=load(), provenance_before=provenance())
    t0 = time.perf_counter()
    if "idle" in parts:
        run_idle_cpu(res, args.idle_seconds, args.repeats)
    if "latency" in parts:
        run_latency(res, args.latency_calls, args.repeats)
    if "throughput" in parts:
        run_throughput(res, args.repeats, args.scale)
    else:
        res.add("ideal", ideal_rate(max(10, IDEAL_BATCHES // args.scale)))
    res.wall_s = time.perf_counter() - t0
    res.load_after = load()
    res.provenance_after = provenance()

    text = report(res, args)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
        log(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
