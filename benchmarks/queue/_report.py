"""The report of the queue benchmark's parts (a), (b) and (c): their table and details.

Parts (d), (e) and (g) have their own tables (``report_d``, ``report_e``, ``report_g``), which
the benchmark's main puts after this one.
"""

from __future__ import annotations

from benchmarks.harness import fmt, header, machine, versions
from benchmarks.queue._minilm import where
from benchmarks.queue._service import Config, Results

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


def cell(res: Results, key: str, digits: int = 0, unit: str = "") -> str:
    """The median of a figure, with the range of its repeats in brackets."""
    spread = res.spread(key, digits)
    return fmt(res.med(key), digits, unit) + (f" [{spread}]" if spread else "")


def series(res: Results, key: str, digits: int = 0) -> str:
    return ", ".join(fmt(v, digits) for v in res.rows.get(key, []))


def report(res: Results, cfg: Config, argv: list[str]) -> str:
    lines = _header(res, cfg, argv)
    if set(cfg.parts) & set("abc"):  # the parts of this table (d, e, g have their own)
        lines += [
            "",
            "| Measure | batchline | reference | ratio |",
            "|---|---:|---:|---:|",
        ]
    _table(lines, res, cfg)
    lines += ["", "Details (medians):" if set(cfg.parts) & set("abc") else "Details:", ""]
    _details(lines, res, cfg)
    _per_repeat(lines, res, cfg)
    exits = [
        f"{k.split('_')[0]} worker exit code {v}"
        for k, v in res.info.items()
        if k.endswith("_worker_exit")
    ]
    if exits:
        lines.append(f"- SIGTERM: {', '.join(exits)}.")
    lines += [f"- Note: {note}" for note in res.notes]
    return "\n".join(lines) + "\n"


def _header(res: Results, cfg: Config, argv: list[str]) -> list[str]:
    return [
        "## batchline queue benchmark (Redis service, end to end)",
        "",
        header(res.info.get("provenance"), argv),
        "",
        f"Machine: {machine(res.info.get('load_before', '?'), res.info.get('load_after', '?'))}"
        "; shared with other users.  ",
        f"{versions(*DISTS)}; {res.info.get('redis', '')}  ",
        f"Event loop of the worker and producer processes: {res.info.get('loop', '?')}  ",
        *(
            [f"MiniLM parts (c, e, g): {where(cfg)} (`--dtype {cfg.dtype}`)  "]
            if set(cfg.parts) & set("ceg")
            else []
        ),
        f"Medians of {cfg.repeats} interleaved repeat(s); ratios are medians of per-repeat "
        "ratios; the range of the repeats is in brackets.",
    ]


def _table(lines: list[str], res: Results, cfg: Config) -> None:
    """Appends the rows of parts (a), (b) and (c) to the table: batchline, the reference each
    row names, and their ratio."""
    m = res.med
    if "a" in cfg.parts:
        lines += [
            f"| (a) no-op, end to end, req/s ({cfg.requests:,} requests; {cfg.producers} "
            f"producer process(es), {cfg.inflight} in flight) | {cell(res, 'a_bl_rps')} | arq "
            f"{cell(res, 'a_arq_rps')} ({cfg.arq_requests:,} jobs) | {cell(res, 'a_ratio', 1, 'x')} |",
            f"| (a) latency under that load, p50 / p99 (ms) | {fmt(m('a_bl_p50'), 1)} / "
            f"{fmt(m('a_bl_p99'), 1)} | arq {fmt(m('a_arq_p50'), 1)} / {fmt(m('a_arq_p99'), 1)} "
            "| |",
        ]
    if "b" in cfg.parts:
        lines += [
            f"| (b) idle latency over the model's own time, p50 (ms; {cfg.idle_requests} "
            f"sequential requests) | {cell(res, 'b_p50', 3)} | | |",
            f"| (b) idle latency, p99 (ms) | {cell(res, 'b_p99', 3)} | | |",
            f"| (b) idle latency p50 in PING round trips (redis-py, the producer's loop) | "
            f"{cell(res, 'b_p50', 3, ' ms')} | PING {cell(res, 'b_ping_p50', 3, ' ms')} | "
            f"{cell(res, 'b_in_pings', 1, 'x')} |",
        ]
    if "c" in cfg.parts:
        lines += [
            f"| (c) all-MiniLM-L6-v2, served through Redis vs offline `encode`, sentences/s "
            f"({cfg.sentences:,} sentences; {where(cfg)}, batch {cfg.batch_sizes[0]}) | {cell(res, 'c_served', 1)} | ceiling "
            f"{cell(res, 'c_ceiling', 1)} | {cell(res, 'c_vs_ceiling', 2)} |",
            f"| (c) served vs one sentence at a time through Redis ({cfg.sequential} "
            f"sequential), sentences/s | {cell(res, 'c_served', 1)} | one at a time "
            f"{cell(res, 'c_sequential', 1)} | {cell(res, 'c_vs_sequential', 2, 'x')} |",
        ]


def _details(lines: list[str], res: Results, cfg: Config) -> None:
    m = res.med
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
            f"- (b) CPU per idle request (back to back): worker {fmt(m('b_cpu_worker_us'))} us, "
            f"producer {fmt(m('b_cpu_producer_us'))} us, redis-server "
            f"{fmt(m('b_cpu_redis_us'))} us; per PING round trip: client "
            f"{fmt(m('b_ping_cpu_producer_us'))} us, redis-server "
            f"{fmt(m('b_ping_cpu_redis_us'))} us (what one wake-up and reply cost here).",
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


def _per_repeat(lines: list[str], res: Results, cfg: Config) -> None:
    if "a" in cfg.parts:
        lines.append(
            f"- (a) per repeat: batchline req/s {series(res, 'a_bl_rps')} (other users "
            f"{series(res, 'a_bl_other_cores', 2)} cores); arq req/s {series(res, 'a_arq_rps')} "
            f"(other users {series(res, 'a_arq_other_cores', 2)} cores)."
        )
    if "b" in cfg.parts:
        lines.append(
            f"- (b) per repeat: p50 {series(res, 'b_p50', 3)} ms, p99 {series(res, 'b_p99', 3)}"
            f" ms, PING p50 {series(res, 'b_ping_p50', 3)} ms (other users "
            f"{series(res, 'b_other_cores', 2)} cores)."
        )
    if "c" in cfg.parts:
        lines.append(
            f"- (c) per repeat: served {series(res, 'c_served', 1)} (other users "
            f"{series(res, 'c_other_served', 2)} cores); ceiling {series(res, 'c_ceiling', 1)} "
            f"(other users {series(res, 'c_other_ceiling', 2)} cores); one at a time through "
            f"Redis {series(res, 'c_sequential', 1)}; offline one at a time "
            f"{series(res, 'c_offline_seq', 1)} sentences/s."
        )
