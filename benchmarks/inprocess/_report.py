"""The report of the in-process benchmark: one markdown table per part, and a summary of
batchline against its anchors."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import batchline
from benchmarks.harness import header, machine, ratio, versions
from benchmarks.inprocess._batchers import (
    BATCH_SIZE,
    IMPL_NAMES,
    TASKS,
    THREADS,
    Results,
    fmt_rate,
    fmt_ratio,
)
from benchmarks.inprocess._throughput import COUNTS, THROUGHPUT_ROWS, rounded_up

Write = Callable[[str], None]  # appends a line to the report


def report(res: Results, args: argparse.Namespace) -> str:
    ideal = res.med("ideal")
    out: list[str] = []
    w = out.append
    _header(w, res, args)
    _throughput(w, res, ideal)
    _batches(w, res)
    _repeats(w, res, args)
    _latency(w, res, args)
    _idle_cpu(w, res, args)
    _summary(w, res, ideal)
    return "\n".join(out)


def _header(w: Write, res: Results, args: argparse.Namespace) -> None:
    w("## In-process benchmark: batchline vs batched vs fast-dynamic-batcher\n")
    changed = (
        ""
        if res.provenance_before == res.provenance_after
        else f" (**batchline changed during the run**; at the end: {res.provenance_after})"
    )
    w(header(res.provenance_before + changed))
    w(
        f"- {args.repeats} repeat(s) per throughput cell, median shown"
        + (" (**--quick smoke run: not representative**)" if args.quick else "")
    )
    w(
        f"- machine: {machine(res.load_before, res.load_after)} "
        "(shared machine: other work may run concurrently)"
    )
    w(
        f"- versions: batchline {batchline.__version__}, "
        f"{versions('batched', 'fast-dynamic-batcher', 'numpy')}"
    )
    w(
        f"- batch_size {BATCH_SIZE}, timeout_ms 5 (max_delay 5 ms for fast-dynamic-batcher); "
        f"{THREADS} caller threads (thread API), {TASKS} asyncio tasks (aio API); "
        f"model-like fn = sleep(2 ms + 50 us x items); run took {res.wall_s:.0f} s\n"
    )


def _throughput(w: Write, res: Results, ideal: float | None) -> None:
    w("### Throughput (items/s, median)\n")
    w(
        "| API | function | batchline | batched | fast-dynamic-batcher | no batching "
        "| batchline / batched | paired per repeat | batchline share of ideal "
        "| batched share of ideal |"
    )
    w("|---|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for api, fname, label, _impls in THROUGHPUT_ROWS:
        bl = res.median_rate((api, fname, "batchline"))
        bd = res.median_rate((api, fname, "batched"))
        fdb = res.median_rate((api, fname, "fdb"))
        none = res.median_rate((api, fname, "none"))
        model_row = fname == "model"
        paired = res.paired_ratios((api, fname, "batchline"), (api, fname, "batched"))
        paired_txt = (
            f"{statistics.median(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f})"
            if paired
            else "—"
        )
        w(
            f"| {api} | {label} | {fmt_rate(bl)} | {fmt_rate(bd)} | {fmt_rate(fdb)} "
            f"| {fmt_rate(none)} | {fmt_ratio(ratio(bl, bd))} | {paired_txt} "
            f"| {fmt_ratio(ratio(bl, ideal), True) if model_row else '—'} "
            f"| {fmt_ratio(ratio(bd, ideal), True) if model_row else '—'} |"
        )
    serial = res.median_rate(("thread", "model", "none-serial"))
    w(
        "\n'batchline / batched' is the ratio of the medians; 'paired per repeat' is the median "
        "(and range) of the ratios within each repeat (the implementations alternate within a "
        "repeat, so a pair shares the machine's load at that moment). The aio no-op is run "
        "twice: with the plain (sync) no-op function (batched runs it on a helper thread per "
        "batch; batchline on its own thread until 16 calls in a row were quick, then on the "
        "loop, see inline_below_ms), and with an `async def` no-op, awaited on the loop."
    )
    w(
        f"\nIdeal (model-like fn called back to back on full batches of {BATCH_SIZE}, no "
        f"batcher, same run): **{fmt_rate(ideal)} items/s** "
        f"(repeats: {', '.join(fmt_rate(x) for x in res.rows['ideal'])})."
    )
    fdb_model = res.median_rate(("aio", "model", "fdb"))
    w(
        f"fast-dynamic-batcher share of ideal: {fmt_ratio(ratio(fdb_model, ideal), True)}. "
        f"No batching with the model-like fn: `time.sleep` overlaps freely across threads, so "
        f"unbatched calls from 64 threads are not serialised as on one device; with the calls "
        f"serialised by a lock (one device) it is {fmt_rate(serial)} items/s. The aio "
        "'no batching' model-like cell goes through `asyncio.to_thread` (default executor, "
        f"{min(32, (os.cpu_count() or 1) + 4)} threads); fast-dynamic-batcher's "
        "`process_batched` also goes through `asyncio.to_thread`, which caps the calls in "
        "flight (hence its batch sizes).\n"
    )


def _batches(w: Write, res: Results) -> None:
    w("### Mean batch size (median over repeats)\n")
    w("| API | function | batchline | batched | fast-dynamic-batcher |")
    w("|---|---|---:|---:|---:|")
    for api, fname, label, _impls in THROUGHPUT_ROWS:
        cols = []
        for impl in ("batchline", "batched", "fdb"):
            b = res.median_batch((api, fname, impl))
            cols.append("—" if b is None else f"{b:.1f}")
        w(f"| {api} | {label} | {' | '.join(cols)} |")
    w("")


def _repeats(w: Write, res: Results, args: argparse.Namespace) -> None:
    w("### All throughput repeats (items/s)\n")
    w("| API | function | implementation | items | repeats | median | spread (max/min) |")
    w("|---|---|---|---:|---|---:|---:|")
    for api, fname, label, impls in THROUGHPUT_ROWS:
        for impl in impls:
            rates = res.rates((api, fname, impl))
            if not rates:
                continue
            unit = THREADS if api == "thread" else TASKS
            n = rounded_up(COUNTS[(api, fname, impl)] // args.scale, unit)
            errs = res.errors.get((api, fname, impl), 0)
            w(
                f"| {api} | {label} | {IMPL_NAMES[impl]} | {n} "
                f"| {', '.join(fmt_rate(x) for x in rates)} | {fmt_rate(statistics.median(rates))} "
                f"| {max(rates) / min(rates):.2f}{' **WRONG RESULTS: ' + str(errs) + '**' if errs else ''} |"
            )
    w("")


def _latency(w: Write, res: Results, args: argparse.Namespace) -> None:
    w(
        f"### Single-caller latency on an idle batcher (no-op fn; added over the fn's own "
        f"{res.own_time_us:.2f} us; {args.latency_calls} sequential calls; medians of "
        f"{args.repeats} interleaved repeats)\n"
    )
    w("| implementation | API | timeout_ms | p50 added (ms) | p99 added (ms) |")
    w("|---|---|---:|---:|---:|")
    for (impl, api, t), (p50, p99) in res.latency.items():
        w(f"| {IMPL_NAMES[impl]} | {api} | {t:g} | {p50:.3f} | {p99:.3f} |")
    w("")


def _idle_cpu(w: Write, res: Results, args: argparse.Namespace) -> None:
    w(
        f"### Idle CPU (one call, then {args.idle_seconds:g} s idle; process CPU time in % of "
        f"one core; medians of {args.repeats} interleaved repeats)\n"
    )
    w("| implementation | API | timeout_ms | idle CPU |")
    w("|---|---|---:|---:|")
    for (impl, api, t), pct in res.idle_cpu.items():
        name = "nothing (baseline)" if impl == "baseline" else IMPL_NAMES[impl]
        w(f"| {name} | {api} | {'—' if t is None else f'{t:g}'} | {pct:.2f} % |")
    w("")


def _summary(w: Write, res: Results, ideal: float | None) -> None:
    """batchline's figures against the anchors they name (batched, the ideal, no batcher)."""
    w("### Summary (batchline against its anchors)\n")
    w("| measure | measured |")
    w("|---|---|")
    for api, fname, label in (
        ("thread", "noop", "thread API"),
        ("aio", "noop", "aio API, sync fn"),
        ("aio", "anoop", "aio API, async fn"),
    ):
        r = ratio(
            res.median_rate((api, fname, "batchline")), res.median_rate((api, fname, "batched"))
        )
        paired = res.paired_ratios((api, fname, "batchline"), (api, fname, "batched"))
        extra = f" (paired median {statistics.median(paired):.2f}x)" if paired else ""
        w(f"| no-op throughput / batched ({label}) | {fmt_ratio(r)}{extra} |")
    for api in ("thread", "aio"):
        s = ratio(res.median_rate((api, "model", "batchline")), ideal)
        w(f"| model-like throughput / ideal ({api} API) | {fmt_ratio(s, True)} |")
    for impl_api in ("thread", "aio (sync fn)", "aio (async fn)"):
        lat = res.latency.get(("batchline", impl_api, 0.0))
        measured = "—" if lat is None else f"{lat[0]:.3f} ms"
        w(f"| timeout_ms=0 idle single-caller added latency p50 ({impl_api}) | {measured} |")
    for api in ("thread", "aio"):
        base = res.idle_cpu.get(("baseline", api, None), 0.0)
        for t in (5.0, 0.0):
            pct = res.idle_cpu.get(("batchline", api, t))
            # process_time has some noise of its own: shown net of the no-batcher baseline.
            measured = "—" if pct is None else f"{pct - base:.2f} % (baseline {base:.2f} %)"
            w(f"| idle CPU, net of baseline ({api} API, timeout_ms={t:g}) | {measured} |")
    w("")
