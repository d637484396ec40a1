"""Generation throughput in process: one at a time, static batching, transformers'
continuous batching (generate_batch, tuned) and batchline, on SmolLM2-135M-Instruct; and
batchline through Redis (a private redis-server and one ``--model generate`` worker process).

    python3 scripts/bench_generate.py            # the full workloads (several minutes on 2 cores)
    python3 scripts/bench_generate.py --quick    # a short check of every path

(a) uniform: N chat prompts, greedy, 32 new tokens each, all submitted at once.
(b) mixed: M prompts, max_new_tokens drawn from 8..256, arriving open-loop (Poisson).
Tokens counted are the useful ones: each request's own tokens up to its EOS or limit.
The through-Redis row runs the same workload with producer.infer and is reported as a ratio
to batchline in process (``--skip-redis`` leaves it out). On a shared machine whose load
swings, two runs minutes apart differ by more than the two paths do: ``--redis-ab`` runs
only the uniform workload, in process and through Redis alternately, ``--rounds`` times
each, and reports the ratio of their total rates.

    python3 scripts/bench_generate.py --quick --redis-ab

The via-HTTP row streams the uniform workload through the FastAPI backend's OpenAI route
(``POST /v1/chat/completions``, ``stream: true``, uvicorn in this process, the same worker):
its time to first token (request sent to first event) over the in-process one (call to
first delta). ``--http-ab`` runs only that comparison, alternating, ``--rounds`` times.

    python3 scripts/bench_generate.py --quick --http-ab

``--stream-ab`` measures streaming through Redis (``AsyncProducer.stream``) against the
result alone (``infer``) on the uniform workload, alternately, ``--rounds`` times each:
tokens/s and the time until the caller has its first text (with ``infer``, its whole answer).
``--model-path`` serves another model there (a ``module:callable`` spec, say):

    python3 scripts/bench_generate.py --quick --stream-ab
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import torch

from batchline.generation import Generator, load_causal_lm

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


def static(model: Any, tok: Any, chats: list[Any], limits: list[int], size: int) -> dict[str, Any]:
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
        enc = enc.to(model.device)
        lim = limits[i : i + size]
        with torch.inference_mode():
            out = model.generate(
                **enc, max_new_tokens=max(lim), do_sample=False, pad_token_id=tok.pad_token_id
            )
        for row, limit in zip(out[:, enc["input_ids"].shape[1] :].tolist(), lim, strict=True):
            total += useful(row, limit, eos)
    return {"tokens": total, "wall_s": time.perf_counter() - start}


def tf_batch(
    path: str, tok: Any, chats: list[Any], limits: list[int], device: Any, dtype: Any
) -> dict[str, Any]:
    """transformers' generate_batch, tuned as the issue says; one max_new_tokens for all."""
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="paged|sdpa", dtype=dtype
    )
    model = model.to(device).eval()
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
    cb = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512)
    start = time.perf_counter()
    outs = model.generate_batch(ids, generation_config=config, continuous_batching_config=cb)
    wall = time.perf_counter() - start
    eos = {int(tok.eos_token_id)}
    ordered = sorted(outs.values(), key=lambda o: int(str(o.request_id).split("_")[-1]))
    total = sum(
        useful(list(o.generated_tokens), lim, eos) for o, lim in zip(ordered, limits, strict=True)
    )
    return {"tokens": total, "wall_s": wall}


async def ours(
    gen: Generator, chats: list[Any], limits: list[int], gaps: list[float]
) -> dict[str, Any]:
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
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        "itl_p50": pct(itl, 0.5),
        "itl_p99": pct(itl, 0.99),
        "mean_batch": (gen.loop.batch_rows - rows0) / steps if steps else 0.0,
    }


async def through_redis(
    url: str,
    queue: str,
    chats: list[Any],
    limits: list[int],
    gaps: list[float],
    *,
    stream: bool = False,
) -> dict[str, Any]:
    """The same requests through Redis: one producer, the worker started by main();
    ``stream``: with ``producer.stream`` instead of ``producer.infer``. ``first_s``: until
    each caller had text (with infer, its answer)."""
    from batchline.producer import AsyncProducer

    async with AsyncProducer(redis_url=url, queue=queue, max_queue_depth=0) as producer:
        await producer.infer({"prompt": "Hello", "max_new_tokens": 2}, timeout_s=600)  # loaded

        async def one(chat: Any, limit: int, delay: float) -> tuple[int, float]:
            await asyncio.sleep(delay)
            value = {"messages": chat, "max_new_tokens": limit}
            sent = time.perf_counter()
            if not stream:
                out: dict[str, Any] = await producer.infer(value, timeout_s=3600)
                return out["tokens"], time.perf_counter() - sent
            first = None
            async for chunk in producer.stream(value, timeout_s=3600):
                if first is None and chunk.token_ids:
                    first = time.perf_counter() - sent
                if chunk.result is not None:
                    return chunk.result["tokens"], first or 0.0
            raise AssertionError("a stream ended without its last chunk")

        arrivals = [sum(gaps[: i + 1]) for i in range(len(gaps))]
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(one(c, m, a) for c, m, a in zip(chats, limits, arrivals, strict=True))
        )
        wall = time.perf_counter() - start
    return {"tokens": sum(n for n, _ in outs), "wall_s": wall, "first_s": [f for _, f in outs]}


async def via_http(
    base_url: str, model: str, chats: list[Any], limits: list[int], gaps: list[float]
) -> dict[str, Any]:
    """The same requests streamed through the OpenAI route of the FastAPI backend."""
    import httpx

    ttft: list[float] = []

    async with httpx.AsyncClient(base_url=base_url, timeout=3600) as client:

        async def one(chat: Any, limit: int, delay: float) -> int:
            await asyncio.sleep(delay)
            body = {"model": model, "messages": chat, "max_tokens": limit, "stream": True}
            body["stream_options"] = {"include_usage": True}
            sent, first, tokens = time.perf_counter(), True, 0
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if first:  # sent once the first chunk, the first token, has come
                        ttft.append(time.perf_counter() - sent)
                        first = False
                    usage = json.loads(line[len("data: ") :]).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
            return tokens

        arrivals = [sum(gaps[: i + 1]) for i in range(len(gaps))]
        start = time.perf_counter()
        counts = await asyncio.gather(
            *(one(c, m, a) for c, m, a in zip(chats, limits, arrivals, strict=True))
        )
        wall = time.perf_counter() - start
    return {
        "tokens": sum(counts),
        "wall_s": wall,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
    }


class RedisWorker:
    """A private redis-server and one generation worker process, for the through-Redis rows."""

    def __init__(
        self,
        batch_size: int,
        device: str = "auto",
        dtype: str = "auto",
        model_path: str | None = None,
    ) -> None:
        import contextlib

        from batchline.demo.service import redis_for_demo, start_worker, stop_worker

        self.queue = "bench-generate"
        self.stack = contextlib.ExitStack()
        self.url = redis_for_demo(self.stack, self.queue)
        flags = ["--model", "generate", "--batch-size", str(batch_size)]
        flags += ["--device", device, "--dtype", dtype]
        flags += ["--model-path", model_path] if model_path else []
        worker = start_worker(self.url, self.queue, [*flags, "--max-restarts-per-min", "0"])
        self.stack.callback(stop_worker, worker)
        self.base_url: str | None = None

    def run(
        self, chats: list[Any], limits: list[int], gaps: list[float], *, stream: bool = False
    ) -> dict[str, Any]:
        return asyncio.run(through_redis(self.url, self.queue, chats, limits, gaps, stream=stream))

    def http(self, chats: list[Any], limits: list[int], gaps: list[float]) -> dict[str, Any]:
        """The requests through the FastAPI backend (started on first use) and Redis."""
        if self.base_url is None:
            self.base_url = self._serve()
        return asyncio.run(via_http(self.base_url, self.queue, chats, limits, gaps))

    def _serve(self) -> str:
        """uvicorn on a thread of this process, serving the app for this worker's queue."""
        import socket
        import threading

        import uvicorn

        from batchline.contrib.fastapi import create_app

        app = create_app(
            redis_url=self.url, generation_queue=self.queue, max_queue_depth=0, timeout_s=3600
        )
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not server.started:  # start-up only: a bounded wait on the thread
            thread.join(0.05)
            if not thread.is_alive():
                raise RuntimeError("the FastAPI backend did not start")

        def stop() -> None:
            server.should_exit = True
            thread.join(30)

        self.stack.callback(stop)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def close(self) -> None:
        self.stack.close()


def show(name: str, r: dict[str, Any], base: dict[str, float]) -> None:
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
        f"{name:<28} {r['tokens']:>6} tok {r['wall_s']:7.1f} s {rate:7.1f} tok/s{extra}  {ratios}"
    )


def redis_ab(gen: Generator, redis: RedisWorker, n: int, new: int, rounds: int) -> None:
    """In process and through Redis alternately on one workload; the ratio of the totals."""
    chats, limits = prompts(n), [new] * n
    redis.run(chats[:1], [2], [0.0])  # warm both paths
    asyncio.run(ours(gen, chats[:1], [2], [0.0]))
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


def show_http(r: dict[str, Any], inproc: dict[str, Any]) -> None:
    """The via-HTTP row: its rate, and its time to first token over the in-process one."""
    rate = r["tokens"] / r["wall_s"]
    print(
        f"{'batchline via HTTP + Redis':<28} {r['tokens']:>6} tok {r['wall_s']:7.1f} s "
        f"{rate:7.1f} tok/s ttft p50/p99 {r['ttft_p50'] * 1e3:.0f}/{r['ttft_p99'] * 1e3:.0f} ms"
        f"  ttft p50 {r['ttft_p50'] / inproc['ttft_p50']:.2f}x in process"
    )


def http_ab(gen: Generator, redis: RedisWorker, n: int, new: int, rounds: int) -> None:
    """Time to first token in process and via HTTP + Redis, alternately, on one workload."""
    chats, limits = prompts(n), [new] * n
    redis.http(chats[:1], [2], [0.0])  # warm both paths
    asyncio.run(ours(gen, chats[:1], [2], [0.0]))
    print(f"uniform: {n} chat prompts, greedy, {new} new tokens; alternating, {rounds} rounds")
    ttfts: dict[str, list[float]] = {"in process": [], "via HTTP": []}
    for _ in range(rounds):
        inproc = asyncio.run(ours(gen, chats, limits, [0.0] * n))
        show("batchline", inproc, {})
        http = redis.http(chats, limits, [0.0] * n)
        show_http(http, inproc)
        ttfts["in process"].append(inproc["ttft_p50"])
        ttfts["via HTTP"].append(http["ttft_p50"])
    means = {k: sum(v) / len(v) for k, v in ttfts.items()}
    print(
        f"ttft p50, mean of rounds: in process {means['in process'] * 1e3:.0f} ms, via HTTP + "
        f"Redis {means['via HTTP'] * 1e3:.0f} ms: "
        f"{means['via HTTP'] / means['in process']:.2f}x in process"
    )


def stream_ab(redis: RedisWorker, n: int, new: int, rounds: int) -> None:
    """Through Redis with and without streaming, alternately: tokens/s of the totals and
    the time to the first text (p50 over every request of every round)."""
    chats, limits = prompts(n), [new] * n
    redis.run(chats[:1], [2], [0.0], stream=True)  # warm both paths
    print(f"uniform: {n} chat prompts, greedy, {new} new tokens, through Redis; {rounds} rounds")
    names = {"without streaming (infer)": False, "streaming (stream)": True}
    totals: dict[str, list[Any]] = {name: [0, 0.0, []] for name in names}
    for _ in range(rounds):
        for name, stream in names.items():
            r = redis.run(chats, limits, [0.0] * n, stream=stream)
            rate, first = r["tokens"] / r["wall_s"], pct(r["first_s"], 0.5) * 1e3
            print(f"{name:<28} {r['tokens']:>6} tok {r['wall_s']:7.1f} s {rate:7.1f} tok/s"
                  f" first text p50 {first:.0f} ms")  # fmt: skip
            totals[name][0] += r["tokens"]
            totals[name][1] += r["wall_s"]
            totals[name][2] += r["first_s"]
    (plain, plain_s, plain_first), (streamed, streamed_s, streamed_first) = totals.values()
    ratio = (streamed / streamed_s) / (plain / plain_s)
    print(
        f"streaming: {streamed / streamed_s:.1f} tok/s, {ratio:.2f}x without "
        f"({plain / plain_s:.1f} tok/s); first text p50 {pct(streamed_first, 0.5) * 1e3:.0f} ms "
        f"against {pct(plain_first, 0.5) * 1e3:.0f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workloads: a check, not figures")
    ap.add_argument("--skip-tf", action="store_true", help="skip transformers' generate_batch")
    ap.add_argument("--skip-redis", action="store_true", help="skip the through-Redis rows")
    ap.add_argument(
        "--redis-ab", action="store_true", help="only: in process vs through Redis, alternating"
    )
    ap.add_argument(
        "--http-ab", action="store_true", help="only: ttft in process vs via HTTP, alternating"
    )
    ap.add_argument(
        "--stream-ab", action="store_true", help="only: through Redis, streaming vs infer"
    )
    ap.add_argument("--rounds", type=int, default=2, help="with --*-ab [default 2]")
    ap.add_argument(
        "--model-path", help="with --stream-ab, --http-ab: the model (both sides) [smollm2]"
    )
    ap.add_argument("--device", default="auto", help="every row's device: auto, cpu, cuda")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="every row's dtype (auto: float16 on cuda, float32 on cpu)",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    n_uniform, n_alone, n_mixed, hi = (8, 2, 12, 48) if args.quick else (32, 8, 64, 256)
    on = {"device": args.device, "dtype": args.dtype}
    if args.stream_ab:
        redis = RedisWorker(32, **on, model_path=args.model_path)
        try:
            stream_ab(redis, n_uniform, 16 if args.quick else 32, args.rounds)
        finally:
            redis.close()
        return
    if args.model_path and not args.http_ab:
        ap.error("--model-path goes with --stream-ab or --http-ab")
    if args.model_path and ":" in args.model_path:  # module:callable, as the worker takes it
        from batchline.worker.models import resolve_callable

        model, tok = resolve_callable(args.model_path)()
    else:
        model, tok = load_causal_lm(*([args.model_path] if args.model_path else []), **on)
    where = (model.device, model.dtype)  # as picked for the model: the other rows' too
    print(f"device {model.device}, dtype {model.dtype}")
    gen = Generator(model, tokenizer=tok, max_batch_size=32)
    redis = None if args.skip_redis else RedisWorker(32, **on, model_path=args.model_path)
    if (args.redis_ab or args.http_ab) and redis is not None:
        ab = redis_ab if args.redis_ab else http_ab
        ab(gen, redis, n_uniform, 16 if args.quick else 32, args.rounds)
        redis.close()
        gen.loop.close()
        return
    eos_note = "tokens counted up to each request's EOS or limit"

    print(f"(a) uniform: {n_uniform} chat prompts, greedy, 32 new tokens ({eos_note})")
    chats, limits = prompts(n_uniform), [32] * n_uniform
    alone = static(model, tok, chats[:n_alone], limits[:n_alone], 1)
    show(f"one at a time ({n_alone} prompts)", alone, {})
    stat = static(model, tok, chats, limits, n_uniform)
    show("static (one generate)", stat, {"one at a time": alone["tokens"] / alone["wall_s"]})
    base = {"static": stat["tokens"] / stat["wall_s"]}
    if not args.skip_tf:
        tf = tf_batch(model.name_or_path, tok, chats, limits, *where)
        show("generate_batch (tuned)", tf, base)
        base["generate_batch"] = tf["tokens"] / tf["wall_s"]
    inproc = asyncio.run(ours(gen, chats, limits, [0.0] * n_uniform))
    show("batchline", inproc, base)
    if redis is not None:
        own = {"in process": inproc["tokens"] / inproc["wall_s"]}
        show("batchline through Redis", redis.run(chats, limits, [0.0] * n_uniform), own)
        show_http(redis.http(chats, limits, [0.0] * n_uniform), inproc)

    rnd = random.Random(1)
    chats, limits = prompts(n_mixed), [rnd.randint(8, hi) for _ in range(n_mixed)]
    rate_per_s = 8.0
    gaps = [rnd.expovariate(rate_per_s) for _ in range(n_mixed)]
    print(
        f"(b) mixed: {n_mixed} prompts, max_new_tokens 8..{hi}, Poisson arrivals "
        f"{rate_per_s:.0f}/s (static and generate_batch get them all at once)"
    )
    stat = static(model, tok, chats, limits, 32)
    show("static (batches of 32)", stat, {})
    base = {"static": stat["tokens"] / stat["wall_s"]}
    if not args.skip_tf:
        tf = tf_batch(model.name_or_path, tok, chats, limits, *where)
        show("generate_batch (tuned)", tf, base)
        base["generate_batch"] = tf["tokens"] / tf["wall_s"]
    inproc = asyncio.run(ours(gen, chats, limits, gaps))
    show("batchline", inproc, base)
    if redis is not None:
        own = {"in process": inproc["tokens"] / inproc["wall_s"]}
        show("batchline through Redis", redis.run(chats, limits, gaps), own)
        redis.close()
    gen.loop.close()


if __name__ == "__main__":
    main()
