"""Generation throughput in process: one at a time, static batching, transformers'
continuous batching (generate_batch's manager, tuned) and batchline, on SmolLM2-135M-Instruct;
and batchline through Redis (a private redis-server and one ``--model generate`` worker).

    python3 scripts/bench_generate.py --repeats 3  # the full workloads (long on 2 cores)
    python3 scripts/bench_generate.py --quick      # a short check of every path

(a) uniform: N chat prompts, greedy, 32 new tokens each, all submitted at once.
(b) mixed: M prompts, max_new_tokens drawn from 8..256, arriving open-loop (Poisson) to
batchline; static batching and transformers' manager get them all at once.
Tokens counted are the useful ones: each request's own tokens up to its EOS or limit.

Every row is warmed up (a short untimed run) before anything is timed, and the worker
process has loaded its model and answered before then. ``--repeats N`` runs every row of
both workloads once per repeat, the rows of a repeat in a rotated order, so that a shared
machine's load swings reach all rows alike; the summary gives each figure's median over the
repeats and ratios of median rates. ``--redis-ab`` runs only the uniform workload, in process
and through Redis alternately, ``--rounds`` times each, and reports the ratio of the totals.

    python3 scripts/bench_generate.py --quick --redis-ab
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# This checkout's batchline, not whichever one is installed (the worker it starts runs here).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchline.worker._threads import (
    apply_threads,
    available_cpus,
    prepare_environment,
)

# The worker's CPU threading (batchline.worker._threads), for the in-process rows too, set
# before torch loads: the cores this process may use, and OpenMP threads that wait passively
# (spinning ones take the cores from the other threads and processes of a shared machine).
prepare_environment(available_cpus())

import torch  # noqa: E402

from batchline.generation import Generator, load_causal_lm  # noqa: E402

TOPICS = [
    "the capital of France",
    "photosynthesis",
    "a haiku about rain",
    "why the sky is blue",
    "black holes",
    "how to boil an egg",
    "the French revolution",
    "prime numbers",
    "the water cycle",
    "machine learning",
    "a good breakfast",
    "the moon landing",
    "volcanoes",
    "how bees make honey",
    "the Roman empire",
    "gravity",
]
HEARTBEAT_S = 0.5  # the bench worker's; its statistics (the running batch) come with it

Result = dict[str, Any]


def prompts(n: int) -> list[list[dict[str, str]]]:
    verbs = ["Tell me about", "Explain", "Write two sentences on"]
    return [
        [{"role": "user", "content": f"{verbs[i % 3]} {TOPICS[i % len(TOPICS)]}."}]
        for i in range(n)
    ]


def useful(tokens: list[int], limit: int, eos: set[int]) -> int:
    for i, t in enumerate(tokens[:limit]):
        if t in eos:
            return i + 1
    return min(len(tokens), limit)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latencies(ttft: list[float], itl: list[float]) -> Result:
    return {
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        "itl_p50": pct(itl, 0.5),
        "itl_p99": pct(itl, 0.99),
    }


# -- the anchors -------------------------------------------------------------------------------


def static(model: Any, tok: Any, chats: list[Any], limits: list[int], size: int) -> Result:
    """Left-padded model.generate over batches of ``size`` in order; each runs to its max."""
    tok.padding_side = "left"
    eos = {int(tok.eos_token_id)}
    total, start = 0, time.perf_counter()
    for i in range(0, len(chats), size):
        texts = [
            tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
            for c in chats[i : i + size]
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        lim = limits[i : i + size]
        with torch.inference_mode():
            out = model.generate(
                **enc, max_new_tokens=max(lim), do_sample=False, pad_token_id=tok.pad_token_id
            )
        for row, limit in zip(out[:, enc["input_ids"].shape[1] :].tolist(), lim, strict=True):
            total += useful(row, limit, eos)
    return {"tokens": total, "wall_s": time.perf_counter() - start}


def paged_model(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged|sdpa").eval()


def tf_batch(model: Any, tok: Any, chats: list[Any], limits: list[int]) -> Result:
    """transformers' continuous batching, tuned as the issue says
    (``ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512)``), through the manager
    that ``generate_batch`` drives, with each request's own ``max_new_tokens`` (which
    ``generate_batch`` cannot give: it has one for all). Timed from the manager's start (its
    cache allocation, as in ``generate_batch``) to the last result."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    ids = [
        tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
        for c in chats
    ]
    config = GenerationConfig(
        max_new_tokens=max(limits),
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    hints = WorkloadHints(  # as generate_batch computes them
        max_prompt_length=max(len(i) for i in ids),
        max_generated_length=max(limits),
        num_requests=len(ids),
    )
    cb = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512)
    outs: dict[str, Any] = {}
    start = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb, timeout=5, workload_hints=hints
    ) as manager:
        for k, (prompt, limit) in enumerate(zip(ids, limits, strict=True)):
            manager.add_request(prompt, request_id=f"r{k}", max_new_tokens=limit)
        while len(outs) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                outs[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError("transformers' generation thread ended early")
    wall = time.perf_counter() - start
    eos = {int(tok.eos_token_id)}
    total = sum(
        useful(list(outs[f"r{k}"].generated_tokens), limit, eos) for k, limit in enumerate(limits)
    )
    return {"tokens": total, "wall_s": wall}


# -- batchline ---------------------------------------------------------------------------------


async def ours(gen: Generator, chats: list[Any], limits: list[int], gaps: list[float]) -> Result:
    ttft: list[float] = []
    itl: list[float] = []
    steps0, rows0 = gen.loop.steps, gen.loop.batch_rows

    async def one(chat: Any, limit: int, delay: float) -> int:
        await asyncio.sleep(delay)
        sent = last = time.perf_counter()
        n = 0
        async for delta in gen.stream(messages=chat, max_new_tokens=limit):
            now = time.perf_counter()
            (ttft if n == 0 else itl).append(now - (sent if n == 0 else last))
            last, n = now, n + len(delta.token_ids)
        return n

    arrivals = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    start = time.perf_counter()
    counts = await asyncio.gather(
        *(one(c, m, a) for c, m, a in zip(chats, limits, arrivals, strict=True))
    )
    wall = time.perf_counter() - start
    steps = gen.loop.steps - steps0
    return {
        "tokens": sum(counts),
        "wall_s": wall,
        **latencies(ttft, itl),
        "mean_batch": (gen.loop.batch_rows - rows0) / steps if steps else 0.0,
    }


async def through_redis(
    url: str, queue: str, chats: list[Any], limits: list[int], gaps: list[float]
) -> Result:
    """The same requests through Redis: one producer, the worker started by RedisWorker.

    The result carries the worker's timings, not each token's: time to first token is the
    client's latency less the worker's time from first token to end (it includes Redis both
    ways); inter-token latency is per request, its mean ((total - ttft) / (tokens - 1))."""
    from batchline.producer import AsyncProducer

    async with AsyncProducer(redis_url=url, queue=queue, max_queue_depth=0) as producer:

        async def one(chat: Any, limit: int, delay: float) -> tuple[dict[str, Any], float]:
            await asyncio.sleep(delay)
            sent = time.perf_counter()
            value = {"messages": chat, "max_new_tokens": limit}
            out: dict[str, Any] = await producer.infer(value, timeout_s=3600)
            return out, time.perf_counter() - sent

        arrivals = [sum(gaps[: i + 1]) for i in range(len(gaps))]
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(one(c, m, a) for c, m, a in zip(chats, limits, arrivals, strict=True))
        )
        wall = time.perf_counter() - start
    ttft = [took - (o["total_ms"] - o["ttft_ms"]) / 1e3 for o, took in outs]
    itl = [
        (o["total_ms"] - o["ttft_ms"]) / 1e3 / (o["tokens"] - 1) for o, _ in outs if o["tokens"] > 1
    ]
    return {"tokens": sum(o["tokens"] for o, _ in outs), "wall_s": wall, **latencies(ttft, itl)}


class RedisWorker:
    """A private redis-server and one generation worker process, for the through-Redis rows.

    Built before anything is timed: it returns once the worker has loaded its model and
    answered a request, so its loading never overlaps a timed row."""

    def __init__(self, batch_size: int) -> None:
        import contextlib

        from batchline.demo.service import redis_for_demo, start_worker, stop_worker

        self.queue = "bench-generate"
        self.stack = contextlib.ExitStack()
        self.url = redis_for_demo(self.stack, self.queue)
        flags = ["--model", "generate", "--batch-size", str(batch_size)]
        flags += ["--heartbeat-s", str(HEARTBEAT_S), "--max-restarts-per-min", "0"]
        worker = start_worker(self.url, self.queue, flags)
        self.stack.callback(stop_worker, worker)
        asyncio.run(through_redis(self.url, self.queue, prompts(1), [2], [0.0]))  # loaded

    def _steps(self) -> tuple[int, int, float]:
        """(steps, rows) the worker has run, and when its heartbeat said so."""
        import redis

        from batchline.transport.keys import QueueKeys

        keys = QueueKeys(self.queue)
        client = redis.Redis.from_url(self.url)
        try:
            workers = client.zrange(keys.workers, 0, -1)
            raw = client.get(keys.worker_stats(workers[0].decode())) if workers else None
        finally:
            client.close()
        stats = json.loads(raw) if raw else {}
        histogram = {int(k): v for k, v in stats.get("batch_size_histogram", {}).items()}
        rows = sum(size * n for size, n in histogram.items())
        return sum(histogram.values()), rows, float(stats.get("time", 0.0))

    def run(self, chats: list[Any], limits: list[int], gaps: list[float]) -> Result:
        """One workload through Redis; its mean running batch from the worker's heartbeats
        (read after one more heartbeat period: nan if none came)."""
        steps0, rows0, _ = self._steps()
        out = asyncio.run(through_redis(self.url, self.queue, chats, limits, gaps))
        ended = time.time()
        time.sleep(2 * HEARTBEAT_S)  # one heartbeat after the last result
        steps, rows, at = self._steps()
        fresh = at >= ended and steps > steps0
        out["mean_batch"] = (rows - rows0) / (steps - steps0) if fresh else float("nan")
        return out

    def close(self) -> None:
        self.stack.close()


# -- the rows and their summary ----------------------------------------------------------------


def show(name: str, r: Result, base: dict[str, float]) -> None:
    rate = r["tokens"] / r["wall_s"]
    ratios = " ".join(f"{rate / v:.2f}x {k}" for k, v in base.items() if v)
    extra = ""
    if "ttft_p50" in r:
        extra = (
            f" ttft p50/p99 {r['ttft_p50'] * 1e3:.0f}/{r['ttft_p99'] * 1e3:.0f} ms"
            f" itl p50/p99 {r['itl_p50'] * 1e3:.0f}/{r['itl_p99'] * 1e3:.0f} ms"
            f" mean batch {r['mean_batch']:.1f}"
        )
    print(
        f"{name:<28} {r['tokens']:>6.0f} tok {r['wall_s']:7.1f} s {rate:7.1f} tok/s{extra}  {ratios}",
        flush=True,
    )


def median_row(runs: list[Result]) -> Result:
    """Each figure's median over the repeats (the rate's too, as tokens / wall_s)."""
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["wall_s"] = out["tokens"] / statistics.median(r["tokens"] / r["wall_s"] for r in runs)
    return out


class Workload:
    """One workload's rows (name -> run), run once per repeat; the baselines of each row."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.rows: dict[str, Callable[[], Result]] = {}
        self.bases: dict[str, list[str]] = {}
        self.runs: dict[str, list[Result]] = {}

    def add(self, name: str, run: Callable[[], Result], *bases: str) -> None:
        self.rows[name] = run
        self.bases[name] = list(bases)
        self.runs[name] = []

    def repeat(self, index: int) -> None:
        names = list(self.rows)
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            self.runs[name].append(result := self.rows[name]())
            show(f"  {name}", result, {})

    def summary(self, repeats: int) -> None:
        print(f"{self.title}: median of {repeats} repeat(s)", flush=True)
        medians = {name: median_row(runs) for name, runs in self.runs.items()}
        rates = {n: m["tokens"] / m["wall_s"] for n, m in medians.items()}
        for name, m in medians.items():
            show(name, m, {b: rates[b] for b in self.bases[name]})


def redis_ab(gen: Generator, redis: RedisWorker, n: int, new: int, rounds: int) -> None:
    """In process and through Redis alternately on one workload; the ratio of the totals."""
    chats, limits = prompts(n), [new] * n
    asyncio.run(ours(gen, chats[:1], [2], [0.0]))  # the worker answered one already
    print(f"uniform: {n} chat prompts, greedy, {new} new tokens; alternating, {rounds} rounds")
    totals = {"in process": [0, 0.0], "through Redis": [0, 0.0]}
    for _ in range(rounds):
        for name, run in (
            ("in process", lambda: asyncio.run(ours(gen, chats, limits, [0.0] * n))),
            ("through Redis", lambda: redis.run(chats, limits, [0.0] * n)),
        ):
            r = run()
            show(f"batchline {name}", r, {})
            totals[name][0] += r["tokens"]
            totals[name][1] += r["wall_s"]
    rates = {k: t / s for k, (t, s) in totals.items()}
    print(
        f"total: in process {rates['in process']:.1f} tok/s, through Redis "
        f"{rates['through Redis']:.1f} tok/s: "
        f"{rates['through Redis'] / rates['in process']:.2f}x in process"
    )


def workloads(
    args: argparse.Namespace, model: Any, tok: Any, gen: Generator, redis: RedisWorker | None
) -> list[Workload]:
    n_uniform, n_alone, n_mixed, hi = (8, 2, 12, 48) if args.quick else (32, 8, 64, 256)
    paged = None if args.skip_tf else paged_model(model.name_or_path)
    eos_note = "tokens counted up to each request's EOS or limit"

    def rows(
        w: Workload, chats: list[Any], limits: list[int], gaps: list[float], stat: str
    ) -> None:
        bases = [stat]
        if paged is not None:
            w.add("generate_batch (tuned)", lambda: tf_batch(paged, tok, chats, limits), stat)
            bases.append("generate_batch (tuned)")
        w.add("batchline", lambda: asyncio.run(ours(gen, chats, limits, gaps)), *bases)
        if redis is not None:
            w.add("batchline through Redis", lambda: redis.run(chats, limits, gaps), "batchline")

    a = Workload(f"(a) uniform: {n_uniform} chat prompts, greedy, 32 new tokens ({eos_note})")
    chats, limits = prompts(n_uniform), [32] * n_uniform
    a.add(
        f"one at a time ({n_alone} prompts)",
        lambda: static(model, tok, chats[:n_alone], limits[:n_alone], 1),
    )
    a.add(
        "static (one generate)",
        lambda: static(model, tok, chats, limits, n_uniform),
        f"one at a time ({n_alone} prompts)",
    )
    rows(a, chats, limits, [0.0] * n_uniform, "static (one generate)")

    rnd = random.Random(1)
    mixed, mixed_limits = prompts(n_mixed), [rnd.randint(8, hi) for _ in range(n_mixed)]
    rate_per_s = 8.0
    gaps = [rnd.expovariate(rate_per_s) for _ in range(n_mixed)]
    b = Workload(
        f"(b) mixed: {n_mixed} prompts, max_new_tokens 8..{hi}, Poisson arrivals "
        f"{rate_per_s:.0f}/s (static and generate_batch get them all at once)"
    )
    b.add("static (batches of 32)", lambda: static(model, tok, mixed, mixed_limits, 32))
    rows(b, mixed, mixed_limits, gaps, "static (batches of 32)")

    # Warm-up: every path once, briefly, before anything is timed.
    few, short = prompts(2), [4, 4]
    static(model, tok, few, short, 2)
    if paged is not None:
        tf_batch(paged, tok, few, short)
    asyncio.run(ours(gen, few, short, [0.0, 0.0]))
    if redis is not None:
        redis.run(few, short, [0.0, 0.0])
    return [a, b]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workloads: a check, not figures")
    ap.add_argument("--skip-tf", action="store_true", help="skip transformers' generate_batch")
    ap.add_argument("--skip-redis", action="store_true", help="skip the through-Redis rows")
    ap.add_argument(
        "--redis-ab", action="store_true", help="only: in process vs through Redis, alternating"
    )
    ap.add_argument("--rounds", type=int, default=2, help="with --redis-ab [default 2]")
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs of every row, interleaved [default 1]"
    )
    args = ap.parse_args()
    apply_threads(available_cpus())
    torch.manual_seed(0)
    redis = None if args.skip_redis else RedisWorker(batch_size=32)  # loaded before any timing
    model, tok = load_causal_lm()
    gen = Generator(model, tokenizer=tok, max_batch_size=32)
    try:
        if args.redis_ab and redis is not None:
            redis_ab(gen, redis, 8 if args.quick else 32, 16 if args.quick else 32, args.rounds)
            return
        plan = workloads(args, model, tok, gen, redis)
        for index in range(args.repeats):
            for w in plan:
                print(f"repeat {index + 1}/{args.repeats} {w.title}", flush=True)
                w.repeat(index)
            for w in plan:  # so far: a run stopped early still has its medians
                w.summary(index + 1)
    finally:
        if redis is not None:
            redis.close()
        gen.loop.close()


if __name__ == "__main__":
    main()
