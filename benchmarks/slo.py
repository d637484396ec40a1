"""Latency-SLO mode against fixed settings, in one run, in real time.

A batch function that sleeps 2 ms + 0.4 ms per item (a vectorised model's shape: a fixed cost
per call plus a cost per item; it sleeps, so the CPU stays free for the load generator) is
served by ``batchline.aio.dynamically`` under an open-loop Poisson load at rising rates. At
each rate the script runs the batcher with ``target_p99_ms`` and with every fixed setting of
a sweep (batch size x wait), and reports p99 latency (submit to result) and the served rate.
For each rate it names the best fixed setting that met the target (the most served) and the
ratio of the SLO mode's served rate to it; fixed settings either break the target (a long
wait at a light load) or lose throughput (a small batch at a heavy load). The last lines give
the SLO mode's served rate over the best fixed setting's, where some fixed setting meets the
target (beyond that the load exceeds what any setting serves within it), and at how many of
those rates its p99 was at or under the target. p99 is measured by the load generator (from
each request's scheduled arrival to its result), so stalls of the whole process on a busy
machine count too: the column "generator late" shows how late the load generator itself
submitted (p99, in the SLO run), a floor under every setting's p99; and note the load
average the report prints. ``--repeats`` (3) runs every setting that many times at each rate,
on the same arrivals, the settings' order rotated each repeat; every figure is the median of
the repeats.

    python -m benchmarks.slo            # about 10 minutes
    python -m benchmarks.slo --quick    # about 20 s (one repeat)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Unpack

import batchline
import batchline.aio
from benchmarks.harness import fmt, header, log, machine, percentile, ratio, versions

FIXED_COST_S = 0.002
PER_ITEM_S = 0.0004


def model(xs: list[int]) -> list[int]:
    time.sleep(FIXED_COST_S + PER_ITEM_S * len(xs))
    return xs


@dataclass
class Run:
    p99_ms: float
    late_p99_ms: float  # how late the generator itself submitted: the process not running
    served_per_s: float
    batch_size: int
    timeout_ms: float


async def measure(
    rate: float, seconds: float, seed: int, **options: Unpack[batchline.AioOptions]
) -> Run:
    f = batchline.aio.dynamically(**options)(model)
    rng = random.Random(seed)
    latencies: list[float] = []
    late: list[float] = []
    warm = seconds / 4
    start = time.monotonic()

    async def one(i: int, at: float) -> None:
        began = time.monotonic()
        await f(i)
        if at - start >= warm:
            latencies.append(time.monotonic() - at)
            late.append(max(0.0, began - at))

    tasks: list[asyncio.Task[None]] = []
    t, i = start, 0
    while t - start < seconds:
        t += rng.expovariate(rate)
        delay = t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i, t)))
        i += 1
    await asyncio.gather(*tasks)
    span = time.monotonic() - start - warm
    stats = f.stats
    await f.aclose()
    latencies.sort()
    late.sort()
    return Run(
        percentile(latencies, 99) * 1e3,
        percentile(late, 99) * 1e3,
        len(latencies) / span,
        stats.batch_size,
        stats.timeout_ms,
    )


@dataclass
class Row:
    rate: float
    slo: Run
    best: tuple[float, str] | None  # (served/s, "size / wait") of the best fixed setting meeting it
    broken: int  # fixed settings whose p99 broke the target


def sweep(
    rate: float,
    seed: int,
    seconds: float,
    target: float,
    grid: tuple[list[int], list[float]],
    repeats: int,
) -> Row:
    """The SLO mode and every fixed setting (sizes x waits of ``grid``) at one offered rate,
    ``repeats`` times: each repeat runs them all on the same arrivals, in an order rotated
    from the last repeat's (a load swing of the shared machine reaches every setting alike),
    and each setting's figures are the medians of its repeats."""
    log(f"rate {rate:g}/s")
    slo: batchline.AioOptions = {"batch_size": 64, "timeout_ms": 20.0, "target_p99_ms": target}
    settings: list[tuple[str, batchline.AioOptions]] = [("slo", slo)]
    settings += [
        (f"{b} / {w:g} ms", {"batch_size": b, "timeout_ms": w}) for b in grid[0] for w in grid[1]
    ]
    runs: dict[str, list[Run]] = {name: [] for name, _ in settings}
    for rep in range(repeats):
        shift = rep * len(settings) // repeats
        for name, options in settings[shift:] + settings[:shift]:
            runs[name].append(asyncio.run(measure(rate, seconds, seed + 1000 * rep, **options)))
    medians = {name: median_run(r) for name, r in runs.items()}
    best: tuple[float, str] | None = None
    broken = 0
    for name, run in list(medians.items())[1:]:
        if run.p99_ms > target:
            broken += 1
        elif best is None or run.served_per_s > best[0]:
            best = (run.served_per_s, name)
    return Row(rate, medians["slo"], best, broken)


def median_run(runs: list[Run]) -> Run:
    """Each figure's median over the repeats; the settings the SLO mode chose, those of the
    repeat with the median p99."""
    middle = sorted(runs, key=lambda r: r.p99_ms)[len(runs) // 2]
    return Run(
        statistics.median(r.p99_ms for r in runs),
        statistics.median(r.late_p99_ms for r in runs),
        statistics.median(r.served_per_s for r in runs),
        middle.batch_size,
        middle.timeout_ms,
    )


def summary(rows: list[Row], target: float) -> list[str]:
    """The summary lines, over the rates where some fixed setting keeps p99 under the target:
    the SLO mode's served rate over the best such setting's, and at how many its own p99 was
    under the target too. Where none does (the load exceeds what any setting can serve within
    the target, or the machine stalled the whole process for longer than the target), the
    rate is named.
    """
    servable = [r for r in rows if r.best is not None]
    met = [r for r in servable if r.slo.p99_ms <= target]
    ratios = [r.slo.served_per_s / r.best[0] for r in servable if r.best is not None]
    beyond = [f"{r.rate:g}/s" for r in rows if r.best is None]
    low = min(ratios, default=float("nan"))
    med = statistics.median(ratios) if ratios else float("nan")
    return [
        f"SLO / best fixed meeting the target, per rate where one met it: min {low:.2f}, "
        f"median {med:.2f}",
        f"p99 at or under {target:g} ms where some fixed setting met it: {len(met)} of "
        f"{len(servable)} rates; no fixed setting met it at: {', '.join(beyond) or 'none'} "
        "(a load beyond what any setting serves within it, or stalls of a busy machine)",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--target-ms", type=float, default=20.0)
    parser.add_argument("--rates", default="200,800,1400,1800")
    parser.add_argument("--seconds", type=float, default=2.0, help="per setting and rate")
    parser.add_argument(
        "--repeats", type=int, help="runs of every setting at each rate (medians) [3; quick 1]"
    )
    args = parser.parse_args()
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if repeats < 1:
        parser.error(f"--repeats must be >= 1, got {repeats}")
    rates = [float(r) for r in args.rates.split(",")]
    sizes, waits = [4, 8, 16, 32, 64], [0.0, 5.0, 20.0]
    if args.quick:
        rates, sizes, waits, args.seconds = [200.0, 1400.0], [8, 64], [0.0, 20.0], 1.5
    target = args.target_ms
    print("## latency-SLO mode vs fixed settings")
    print(header())
    print(f"- {machine()}; {versions('batchline')}")
    print(
        f"model: sleep {FIXED_COST_S * 1e3:g} ms + {PER_ITEM_S * 1e3:g} ms per item; Poisson "
        f"load, {args.seconds:g} s per setting and rate (first quarter not counted), medians of "
        f"{repeats} repeat(s), the settings' order rotated each repeat; "
        f"target p99 {target:g} ms; batch size up to 64, wait up to 20 ms in SLO mode"
    )
    print()
    print(
        "| offered/s | SLO p99 ms | SLO p99 / target | generator late, p99 ms | SLO served/s | SLO chose | best fixed meeting target | its served/s | SLO / best | fixed settings breaking target |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows: list[Row] = []
    for n, rate in enumerate(rates):
        row = sweep(rate, n, args.seconds, target, (sizes, waits), repeats)
        rows.append(row)
        slo, best = row.slo, row.best
        r = ratio(slo.served_per_s, best[0] if best else None)
        print(
            f"| {rate:g} | {fmt(slo.p99_ms, 1)} | {fmt(slo.p99_ms / target, 2)} | "
            f"{fmt(slo.late_p99_ms, 1)} | "
            f"{fmt(slo.served_per_s)} | {slo.batch_size} / {slo.timeout_ms:.1f} ms | "
            f"{best[1] if best else 'none'} | {fmt(best[0]) if best else '-'} | {fmt(r, 2)} | "
            f"{row.broken} of {len(sizes) * len(waits)} |",
            flush=True,
        )
    print()
    print("\n".join(summary(rows, target)))
    print(f"load average at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
