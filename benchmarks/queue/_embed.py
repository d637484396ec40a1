"""Part (c) of the queue benchmark: all-MiniLM-L6-v2 served through Redis vs the offline ceiling.

Realistic mixed-length sentences (``batchline.demo.sentences``): sentences/s served through
Redis (one worker, all sentences submitted at once) vs the offline ceiling
``model.encode(sentences, batch_size=B)`` in this process (the worker paused with SIGSTOP,
both with the cores available as torch's thread count, as a worker picks, unless
``--torch-threads``) vs one sentence at a time through Redis (and, for reference, offline). Both sides first see every sentence once (each
new batch shape is slower the first time).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.harness import CpuMeter, log
from benchmarks.queue._minilm import ceiling_model, where, worker_flags
from benchmarks.queue._roles import safe_close
from benchmarks.queue._service import Bench, Config


async def through_redis(
    url: str, queue: str, values: list[str], at_once: bool
) -> tuple[float, list[Any]]:
    """Serve ``values`` all at once (``at_once``) or one at a time; the time and the outputs."""
    from batchline.producer import AsyncProducer

    producer = AsyncProducer(redis_url=url, queue=queue, max_queue_depth=0)
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


def part_c(bench: Bench) -> None:
    from batchline.demo.sentences import sentences

    cfg, res = bench.cfg, bench.res
    texts = sentences(cfg.sentences, seed=7)
    words = [len(t.split()) for t in texts]
    res.info["sentences"] = (
        f"{len(texts)} sentences, {min(words)}-{max(words)} words "
        f"(mean {statistics.fmean(words):.1f}), seed 7"
    )
    queue, size = "bench-embed", cfg.batch_sizes[0]
    log(f"(c) starting the all-MiniLM-L6-v2 worker ({where(cfg)}, batch {size}) ...")
    wpid, wid = bench.spawn_worker(
        "embed-worker",
        queue,
        "sentence-transformers",
        *worker_flags(cfg),
        *cfg.worker_args,
        batch_size=size,
    )
    threads = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=bench.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    ).stdout.strip()
    # Warm-up with every sentence twice: each new (batch, length) shape is slower the first
    # time, on both sides, and the worker's length grouping forms other batches each pass.
    for _ in range(2):
        asyncio.run(through_redis(bench.url, queue, texts, True))
    log("(c) loading the model in this process for the offline ceiling ...")
    bench.procs.pause("embed-worker")
    model = ceiling_model(cfg)
    model.encode(texts, batch_size=size)  # warm-up, every shape once
    bench.procs.resume("embed-worker")
    res.info["torch_threads"] = _torch_threads(cfg, threads)
    for rep in range(cfg.repeats):
        _repeat(bench, model, texts, queue, wpid, wid, rep)
    rc = bench.procs.stop("embed-worker")
    res.info["embed_worker_exit"] = str(rc)


def _torch_threads(cfg: Config, threads: str) -> str:
    """Torch's threads in this process and in a fresh one with the worker's environment."""
    import torch

    return (
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


def _offline(
    bench: Bench, model: Any, texts: list[str], seq_texts: list[str]
) -> tuple[Any, float, dict[str, float], float]:
    """The offline ceiling, the worker paused: the embeddings, sentences/s and the CPU used,
    and the sentences/s of the same model one sentence at a time."""
    bench.procs.pause("embed-worker")
    try:
        meter2 = CpuMeter({"bench": os.getpid()})
        t = time.perf_counter()
        offline = model.encode(texts, batch_size=bench.cfg.batch_sizes[0])
        ceiling_rate = len(texts) / (time.perf_counter() - t)
        cpu2 = meter2.done()
        # what batching can gain on this CPU at all: the same model, one at a time
        t = time.perf_counter()
        for text in seq_texts:
            model.encode([text], batch_size=1)
        offline_seq_rate = len(seq_texts) / (time.perf_counter() - t)
    finally:
        bench.procs.resume("embed-worker")
    return offline, ceiling_rate, cpu2, offline_seq_rate


def _repeat(
    bench: Bench, model: Any, texts: list[str], queue: str, wpid: int, wid: str, rep: int
) -> None:
    """One repeat: all at once through Redis, one at a time, and the offline ceiling; the
    offline side first in every other repeat (a machine that drifts through the run favours
    neither)."""
    import numpy as np

    cfg, res = bench.cfg, bench.res
    seq_texts = texts[: cfg.sequential]
    if rep % 2:
        offline, ceiling_rate, cpu2, offline_seq_rate = _offline(bench, model, texts, seq_texts)
    before = bench.worker_stats(queue, wid)
    meter = CpuMeter(
        {"worker": wpid, "bench": os.getpid(), "redis": bench.procs.procs["redis-server"].pid}
    )
    elapsed, served = asyncio.run(through_redis(bench.url, queue, texts, True))
    cpu = meter.done()
    after = bench.worker_stats(queue, wid, newer_than=time.time())
    served_rate = len(texts) / elapsed
    batch = bench.batch_delta(before, after)

    seq_elapsed, _ = asyncio.run(through_redis(bench.url, queue, seq_texts, False))
    seq_rate = len(seq_texts) / seq_elapsed

    if not rep % 2:
        offline, ceiling_rate, cpu2, offline_seq_rate = _offline(bench, model, texts, seq_texts)
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
