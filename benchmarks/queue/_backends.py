"""Part (d) of the queue benchmark: all-MiniLM-L6-v2 served through Redis on each CPU backend.

One worker process per backend (``--backend torch``, the anchor, ``onnx``, ``onnx-int8``,
``openvino``, ``openvino-int8``; ``--backends`` picks; ``torch-deterministic`` is torch in
deterministic mode, the anchor being torch with the mode off), each in ``--dtype float32``
(the anchor is torch float32 by definition) on its own queue, all started
before the first measurement (the first start exports the model to ONNX once, cached under
``$BATCHLINE_CACHE_DIR``); every worker has the default ``threads`` (the cores available).
Only the worker being measured runs: the others are paused with SIGSTOP. Each repeat serves
the same sentences, all submitted at once, through each backend in turn (the order rotates
from repeat to repeat); figures are medians of the repeats and ratios to torch are medians
of per-repeat ratios. The embeddings each backend served are compared with torch's: the
minimum cosine over all sentences is reported.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.harness import fmt, log

BACKENDS = ("torch", "onnx", "onnx-int8", "openvino", "openvino-int8")

#: ``--backends`` may name these too: torch with the worker's flags that follow.
VARIANTS = {"torch-deterministic": ["--backend", "torch", "--deterministic", "true"]}


def flags(backend: str) -> list[str]:
    """A backend's worker flags: the anchor torch with deterministic mode off (whatever the
    worker's default), a variant's own, or the backend's."""
    if backend == "torch":
        return ["--backend", "torch", "--deterministic", "false"]
    return VARIANTS.get(backend, ["--backend", backend])


def _name(backend: str) -> str:
    return f"backend-{backend}"


async def serve(url: str, queue: str, texts: list[str]) -> tuple[float, list[Any]]:
    from batchline.producer import AsyncProducer

    producer = AsyncProducer(redis_url=url, queue=queue, max_queue_depth=0)
    await producer.start()
    try:
        t = time.perf_counter()
        outs = await producer.map(texts, timeout_s=600)
        return time.perf_counter() - t, outs
    finally:
        task = asyncio.ensure_future(producer.aclose())
        done, _ = await asyncio.wait({task}, timeout=5.0)
        if not done:  # see _roles.safe_close
            task.cancel()


def min_cosine(got: Any, want: Any) -> float:
    import numpy as np

    a, b = np.stack(got), np.stack(want)
    dots = (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(dots.min())


def part_d(bench: Any, backends: list[str]) -> None:
    """Measure each backend served through Redis (``bench`` is _service's Bench)."""
    from batchline.demo.sentences import sentences

    cfg, res, procs = bench.cfg, bench.res, bench.procs
    texts = sentences(cfg.sentences, seed=7)
    backends = ["torch", *[b for b in backends if b != "torch"]]
    res.info["d_sentences"] = f"{len(texts)} sentences, seed 7"
    queues: dict[str, str] = {}
    for backend in backends:
        log(f"(d) starting the {backend} worker (first start of a backend exports once) ...")
        queues[backend] = f"bench-{backend}"
        bench.spawn_worker(
            _name(backend),
            queues[backend],
            "sentence-transformers",
            "--device", "cpu",
            *flags(backend),
            "--dtype", "float32",  # the anchor, torch float32, by definition; the others too
            *cfg.worker_args,
        )  # fmt: skip
        procs.pause(_name(backend))
    reference: list[Any] = []
    for backend in backends:  # warm-up: every (batch, length) shape once
        procs.resume(_name(backend))
        _, outs = asyncio.run(serve(bench.url, queues[backend], texts))
        procs.pause(_name(backend))
        if backend == "torch":
            reference = outs
        else:
            res.add(f"d_cos_{backend}", min_cosine(outs, reference))
    for rep in range(cfg.repeats):
        order = backends[rep % len(backends) :] + backends[: rep % len(backends)]
        rates: dict[str, float] = {}
        for backend in order:
            procs.resume(_name(backend))
            try:
                elapsed, outs = asyncio.run(serve(bench.url, queues[backend], texts))
            finally:
                procs.pause(_name(backend))
            rates[backend] = len(texts) / elapsed
            res.add(f"d_rate_{backend}", rates[backend])
            if backend != "torch":
                res.add(f"d_cos_{backend}", min_cosine(outs, reference))
        for backend in backends[1:]:
            res.add(f"d_ratio_{backend}", rates[backend] / rates["torch"])
        log(f"(d) backends  #{rep + 1}: " + ", ".join(f"{b} {rates[b]:,.1f}/s" for b in backends))
    for backend in backends:
        procs.resume(_name(backend))
        res.info[f"d-{backend}_worker_exit"] = str(procs.stop(_name(backend)))


def report_d(res: Any, cfg: Any, backends: list[str]) -> list[str]:
    """The part's table, for the benchmark's report."""
    m = res.med
    lines = [
        "",
        f"### (d) all-MiniLM-L6-v2 served through Redis per CPU backend "
        f"({res.info.get('d_sentences', '')}, all at once, batch 32)",
        "",
        "| backend | sentences/s | ratio to torch float32 | min cosine to torch float32 |",
        "|---|---:|---:|---:|",
        f"| torch float32 | {fmt(m('d_rate_torch'), 1)} | 1.00 | |",
    ]
    for backend in [b for b in backends if b != "torch"]:
        ratio, cosine = m(f"d_ratio_{backend}"), res.rows.get(f"d_cos_{backend}")
        worst = min(cosine) if cosine else None
        spread = res.spread(f"d_ratio_{backend}")
        lines.append(
            f"| {backend} | {fmt(m(f'd_rate_{backend}'), 1)} | {fmt(ratio, 2)}"
            f"{f' [{spread}]' if spread else ''} | {fmt(worst, 4)} |"
        )
    per_repeat = "; ".join(
        f"{b} " + ", ".join(fmt(v, 1) for v in res.rows.get(f"d_rate_{b}", []))
        for b in ["torch", *[b for b in backends if b != "torch"]]
    )
    lines += ["", f"- (d) per repeat, sentences/s: {per_repeat}."]
    return lines
