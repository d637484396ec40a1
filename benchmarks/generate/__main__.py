"""Generation throughput in process: one at a time, static batching, transformers'
continuous batching (generate_batch's manager, tuned) and batchline, on SmolLM2-135M-Instruct;
and batchline through Redis (a private redis-server, the newest found or ``--redis-server``'s,
whatever ``BATCHLINE_REDIS_URL`` says, and one ``--model generate`` worker).

    python3 -m benchmarks.generate --repeats 3  # the full workloads (long on 2 cores)
    python3 -m benchmarks.generate --quick      # a short check of every path

(a) uniform: N chat prompts, greedy, 32 new tokens each, all submitted at once.
(b) mixed: M prompts, max_new_tokens drawn from 8..256, arriving open-loop (Poisson) to
batchline; static batching and transformers' manager get them all at once, and in a second
transformers row (arrivals) the manager gets them at the same times as batchline, streamed,
its time to first token measured. batchline runs ``--max-running`` sequences at most (64).
Tokens counted are the useful ones: each request's own tokens up to its EOS or limit.

Every path is warmed up before anything is timed, on a batch of the uniform workload's size
(4 new tokens each), and the worker process has loaded its model and answered before then.
Every run of a row sends chat prompts no earlier run sent (each user message ends with a
reference number: a set per run, ``_rows.PromptSets``), so that no row finds its prompts in
the prefix cache that an earlier row or repeat filled; what they share is the chat
template's system prompt, cached by the warm-up. ``--repeats N`` runs every row of
both workloads once per repeat, the rows of a repeat in a rotated order, so that a shared
machine's load swings reach all rows alike; the summary gives each figure's median over the
repeats and ratios of median rates. ``--redis-ab`` runs only the uniform workload, in process
and through Redis alternately, ``--rounds`` times each, and reports the ratio of the totals.

    python3 -m benchmarks.generate --quick --redis-ab

The via-HTTP row streams the uniform workload through the FastAPI backend's OpenAI route
(``POST /v1/chat/completions``, ``stream: true``, uvicorn in this process, the same worker):
its time to first token (request sent to first event) over the in-process one (call to
first delta). ``--http-ab`` runs only that comparison, alternating, ``--rounds`` times.

    python3 -m benchmarks.generate --quick --http-ab

``--stream-ab`` measures streaming through Redis (``AsyncProducer.stream``) against the
result alone (``infer``) on the uniform workload, alternately, ``--rounds`` times each:
tokens/s and the time until the caller has its first text (with ``infer``, its whole answer).
``--model-path`` serves another model there (a ``module:callable`` spec, say):

    python3 -m benchmarks.generate --quick --stream-ab

``--device`` and ``--dtype`` place every row's model (in process, transformers' and the
worker's). ``--deterministic`` adds a row to both workloads: batchline in process in
deterministic mode (``Generator(deterministic=True)``, a second copy of the model), its
rate and TTFT against batchline's:

    python3 -m benchmarks.generate --deterministic --skip-tf --skip-redis --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from batchline.worker._cpu_threads import (
    apply_threads,
    available_cpus,
    prepare_environment,
)

# The worker's CPU threading (batchline.worker._cpu_threads), for the in-process rows too, set
# before torch loads: the cores this process may use, and OpenMP threads that wait passively
# (spinning ones take the cores from the other threads and processes of a shared machine).
prepare_environment(available_cpus())

import torch  # noqa: E402

from batchline.generation import Generator, load_causal_lm  # noqa: E402
from benchmarks.generate._redis import RedisWorker, Result  # noqa: E402
from benchmarks.generate._rows import PromptSets, Workload, ours, show, useful  # noqa: E402
from benchmarks.harness import (  # noqa: E402
    add_redis_server_flag,
    drop_batchline_env,
    header,
    percentile,
    redis_server,
)

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
        enc = enc.to(model.device)
        lim = limits[i : i + size]
        with torch.inference_mode():
            out = model.generate(
                **enc, max_new_tokens=max(lim), do_sample=False, pad_token_id=tok.pad_token_id
            )
        for row, limit in zip(out[:, enc["input_ids"].shape[1] :].tolist(), lim, strict=True):
            total += useful(row, limit, eos)
    return {"tokens": total, "wall_s": time.perf_counter() - start}


def paged_model(path: str, device: Any, dtype: Any) -> Any:
    """The model for transformers' rows, on the device and in the dtype of batchline's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="paged|sdpa", dtype=dtype
    )
    return model.to(device).eval()


def tf_batch(
    model: Any, tok: Any, chats: list[Any], limits: list[int], gaps: list[float] | None = None
) -> Result:
    """transformers' continuous batching, tuned as the issue says
    (``ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512)``), through the manager
    that ``generate_batch`` drives, with each request's own ``max_new_tokens`` (which
    ``generate_batch`` cannot give: it has one for all). Timed from the manager's start (its
    cache allocation, as in ``generate_batch``) to the last result.

    ``gaps`` None: every request added at once, as ``generate_batch`` does. Else each is
    added at its arrival (a thread sleeping out the gaps, as batchline's callers do), streamed,
    and its time to first token measured from its arrival to its first token's output."""
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
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    start = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb, timeout=5, workload_hints=hints
    ) as manager:

        def add(k: int) -> None:
            sent[f"r{k}"] = time.perf_counter()
            streaming = gaps is not None
            manager.add_request(
                ids[k], request_id=f"r{k}", max_new_tokens=limits[k], streaming=streaming
            )

        feeder = None
        if gaps is None:
            for k in range(len(ids)):
                add(k)
        else:
            arrivals = [sum(gaps[: i + 1]) for i in range(len(gaps))]

            def feed() -> None:
                for k, at in enumerate(arrivals):
                    time.sleep(max(0.0, start + at - time.perf_counter()))
                    add(k)

            feeder = threading.Thread(target=feed, daemon=True)
            feeder.start()
        while len(outs) < len(ids):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' generation thread ended early")
                continue
            if out.request_id not in first and len(out.generated_tokens):
                first[out.request_id] = time.perf_counter()
            if out.is_finished():
                outs[out.request_id] = out
        if feeder is not None:
            feeder.join()
    wall = time.perf_counter() - start
    eos = {int(tok.eos_token_id)}
    total = sum(
        useful(list(outs[f"r{k}"].generated_tokens), limit, eos) for k, limit in enumerate(limits)
    )
    result: Result = {"tokens": total, "wall_s": wall}
    if gaps is not None:
        ttft = [first[r] - sent[r] for r in first]
        result.update({"ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99)})
    return result


def warm(
    runs: list[Callable[[list[Any], list[int], list[float]], object]], n: int, fresh: PromptSets
) -> None:
    """Each path once, untimed, on a batch of ``n`` prompts of its own, 4 new tokens each: the
    shapes of the batch it will time (its prefill and first steps), and the chat template's
    system prompt in each prefix cache, as a server that has answered before has it (the
    prompts from ``fresh``, which the timed runs draw theirs from too)."""
    for run in runs:
        run(fresh(n), [4] * n, [0.0] * n)


def alternate(
    runs: dict[str, Callable[[], Result]],
    rounds: int,
    line: Callable[[str, Result], None] = lambda name, r: show(f"batchline {name}", r, {}),
) -> dict[str, list[Result]]:
    """Each run once a round, each round in the previous one's order reversed; ``line``
    prints each result."""
    out: dict[str, list[Result]] = {name: [] for name in runs}
    order = list(runs)
    for _ in range(rounds):
        for name in order:
            out[name].append(runs[name]())
            line(name, out[name][-1])
        order.reverse()
    return out


def first_text(name: str, r: Result) -> None:
    """A line of ``stream_ab``: the rate and the callers' first text, p50."""
    rate, first = r["tokens"] / r["wall_s"], percentile(r["first_s"], 50) * 1e3
    print(f"{name:<28} {r['tokens']:>6} tok {r['wall_s']:7.1f} s {rate:7.1f} tok/s"
          f" first text p50 {first:.0f} ms", flush=True)  # fmt: skip


def redis_ab(gen: Generator, redis: RedisWorker, n: int, new: int, rounds: int) -> None:
    """In process and through Redis alternately on one workload; the ratio of the totals."""
    fresh, limits, now = PromptSets(), [new] * n, [0.0] * n
    warm([lambda *w: asyncio.run(ours(gen, *w)), redis.run], n, fresh)
    print(f"uniform: {n} chat prompts, greedy, {new} new tokens; alternating, {rounds} rounds")
    runs = alternate(
        {
            "in process": lambda: asyncio.run(ours(gen, fresh(n), limits, now)),
            "through Redis": lambda: redis.run(fresh(n), limits, now),
        },
        rounds,
    )
    rates = {k: sum(r["tokens"] for r in v) / sum(r["wall_s"] for r in v) for k, v in runs.items()}
    print(
        f"total: in process {rates['in process']:.1f} tok/s, through Redis "
        f"{rates['through Redis']:.1f} tok/s: "
        f"{rates['through Redis'] / rates['in process']:.2f}x in process"
    )


def http_ab(gen: Generator, redis: RedisWorker, n: int, new: int, rounds: int) -> None:
    """Time to first token in process and via HTTP + Redis, alternately, on one workload."""
    fresh, limits, now = PromptSets(), [new] * n, [0.0] * n
    warm([lambda *w: asyncio.run(ours(gen, *w)), redis.http], n, fresh)
    print(f"uniform: {n} chat prompts, greedy, {new} new tokens; alternating, {rounds} rounds")
    runs = alternate(
        {
            "in process": lambda: asyncio.run(ours(gen, fresh(n), limits, now)),
            "via HTTP + Redis": lambda: redis.http(fresh(n), limits, now),
        },
        rounds,
    )
    means = {k: sum(r["ttft_p50"] for r in v) / len(v) for k, v in runs.items()}
    print(
        f"ttft p50, mean of rounds: in process {means['in process'] * 1e3:.0f} ms, via HTTP + "
        f"Redis {means['via HTTP + Redis'] * 1e3:.0f} ms: "
        f"{means['via HTTP + Redis'] / means['in process']:.2f}x in process"
    )


def stream_ab(redis: RedisWorker, n: int, new: int, rounds: int) -> None:
    """Through Redis with and without streaming, alternately: tokens/s of the totals and
    the time to the first text (p50 over every request of every round)."""
    fresh, limits, now = PromptSets(), [new] * n, [0.0] * n
    warm([redis.run, lambda *w: redis.run(*w, stream=True)], n, fresh)
    print(f"uniform: {n} chat prompts, greedy, {new} new tokens, through Redis; {rounds} rounds")
    runs = alternate(
        {
            "without streaming (infer)": lambda: redis.run(fresh(n), limits, now),
            "streaming (stream)": lambda: redis.run(fresh(n), limits, now, stream=True),
        },
        rounds,
        first_text,
    )
    totals = [
        (
            sum(r["tokens"] for r in v),
            sum(r["wall_s"] for r in v),
            [f for r in v for f in r["first_s"]],
        )
        for v in runs.values()
    ]
    (plain, plain_s, plain_first), (streamed, streamed_s, streamed_first) = totals
    ratio = (streamed / streamed_s) / (plain / plain_s)
    print(
        f"streaming: {streamed / streamed_s:.1f} tok/s, {ratio:.2f}x without "
        f"({plain / plain_s:.1f} tok/s); first text p50 {percentile(streamed_first, 50) * 1e3:.0f} ms "
        f"against {percentile(plain_first, 50) * 1e3:.0f} ms"
    )


def workloads(
    args: argparse.Namespace,
    model: Any,
    tok: Any,
    gen: Generator,
    redis: RedisWorker | None,
    det: Generator | None = None,
) -> list[Workload]:
    """The two workloads' rows. Every call of a row sends a prompt set of its own
    (:class:`PromptSets`): the same sizes, limits and arrivals each time."""
    n_uniform, n_alone, n_mixed, hi = (8, 2, 12, 48) if args.quick else (32, 8, 64, 256)
    paged = None if args.skip_tf else paged_model(model.name_or_path, model.device, model.dtype)
    eos_note = "tokens counted up to each request's EOS or limit"
    fresh = PromptSets()

    def rows(w: Workload, n: int, limits: list[int], gaps: list[float], stat: str) -> None:
        bases = [stat]
        if paged is not None:
            w.add("generate_batch (tuned)", lambda: tf_batch(paged, tok, fresh(n), limits), stat)
            bases.append("generate_batch (tuned)")
            if any(gaps):  # the same arrivals as batchline's, streamed: its TTFT too
                arriving = "generate_batch (tuned, arrivals)"
                w.add(arriving, lambda: tf_batch(paged, tok, fresh(n), limits, gaps), stat)
                bases.append(arriving)
        w.add("batchline", lambda: asyncio.run(ours(gen, fresh(n), limits, gaps)), *bases)
        if det is not None:
            deterministic = "batchline (deterministic)"
            w.add(
                deterministic, lambda: asyncio.run(ours(det, fresh(n), limits, gaps)), "batchline"
            )
        if redis is not None:
            through = "batchline through Redis"
            w.add(through, lambda: redis.run(fresh(n), limits, gaps), "batchline")

    a = Workload(f"(a) uniform: {n_uniform} chat prompts, greedy, 32 new tokens ({eos_note})")
    limits, at_once = [32] * n_uniform, [0.0] * n_uniform
    alone = f"one at a time ({n_alone} prompts)"
    a.add(alone, lambda: static(model, tok, fresh(n_alone), limits[:n_alone], 1))
    a.add(
        "static (one generate)",
        lambda: static(model, tok, fresh(n_uniform), limits, n_uniform),
        alone,
    )
    rows(a, n_uniform, limits, at_once, "static (one generate)")
    if redis is not None:
        http = "batchline via HTTP + Redis"
        a.add(http, lambda: redis.http(fresh(n_uniform), limits, at_once), ttft_vs="batchline")

    rnd = random.Random(1)
    mixed_limits = [rnd.randint(8, hi) for _ in range(n_mixed)]
    rate_per_s = 8.0
    gaps = [rnd.expovariate(rate_per_s) for _ in range(n_mixed)]
    b = Workload(
        f"(b) mixed: {n_mixed} prompts, max_new_tokens 8..{hi}, Poisson arrivals "
        f"{rate_per_s:.0f}/s (static and generate_batch get them all at once; generate_batch"
        " (arrivals) as batchline does)"
    )
    b.add("static (batches of 32)", lambda: static(model, tok, fresh(n_mixed), mixed_limits, 32))
    rows(b, n_mixed, mixed_limits, gaps, "static (batches of 32)")

    # Warm-up, before anything is timed: every path on a batch of (a)'s size (static batches
    # of (b) are no larger).
    paths: list[Callable[[list[Any], list[int], list[float]], object]] = [
        lambda c, m, _: static(model, tok, c, m, len(c)),
        lambda c, m, g: asyncio.run(ours(gen, c, m, g)),
    ]
    if det is not None:
        paths.append(lambda c, m, g: asyncio.run(ours(det, c, m, g)))
    if paged is not None:
        paths.append(lambda c, m, _: tf_batch(paged, tok, c, m))
    if redis is not None:
        paths += [redis.run, redis.http]  # the backend started, its client warm
    warm(paths, n_uniform, fresh)
    return [a, b]


def parse() -> argparse.Namespace:
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
        "--max-running",
        type=int,
        default=64,
        help="batchline's sequences running at once, in process and the worker's --batch-size"
        " [default 64]",
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs of every row, interleaved [default 1]"
    )
    ap.add_argument(
        "--model-path", help="with --stream-ab, --http-ab: the model (both sides) [smollm2]"
    )
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="add batchline in deterministic mode (in process) to both workloads",
    )
    ap.add_argument("--device", default="auto", help="every row's device: auto, cpu, cuda")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="every row's dtype (auto: float16 on cuda; bfloat16 on a cpu that computes it"
        " natively, else float32)",
    )
    add_redis_server_flag(ap)
    args = ap.parse_args()
    if args.model_path and not (args.stream_ab or args.http_ab):
        ap.error("--model-path goes with --stream-ab or --http-ab")
    return args


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """The in-process model: ``--model-path`` (a ``module:callable`` spec, as the worker
    takes it, or a path) or SmolLM2, on ``--device`` in ``--dtype``."""
    on = {"device": args.device, "dtype": args.dtype}
    if args.model_path and ":" in args.model_path:
        from batchline.worker.models import resolve_callable

        model, tok = resolve_callable(args.model_path)()
        return model, tok
    return load_causal_lm(*([args.model_path] if args.model_path else []), **on)


def measure(args: argparse.Namespace, redis: RedisWorker | None) -> None:
    """The in-process rows beside ``redis``'s: an A/B comparison or the workloads."""
    model, tok = load(args)
    print(f"device {model.device}, dtype {model.dtype}", flush=True)
    gen = Generator(model, tokenizer=tok, max_batch_size=args.max_running)
    det = None
    if args.deterministic:  # a copy of its own: the mode changes a model in place
        det = Generator(
            load(args)[0], tokenizer=tok, max_batch_size=args.max_running, deterministic=True
        )
    try:
        if (args.redis_ab or args.http_ab) and redis is not None:
            ab = redis_ab if args.redis_ab else http_ab
            ab(gen, redis, 8 if args.quick else 32, 16 if args.quick else 32, args.rounds)
            return
        plan = workloads(args, model, tok, gen, redis, det)
        for index in range(args.repeats):
            for w in plan:
                print(f"repeat {index + 1}/{args.repeats} {w.title}", flush=True)
                w.repeat(index)
            for w in plan:  # so far: a run stopped early still has its medians
                w.summary(index + 1)
    finally:
        gen.loop.close()
        if det is not None:
            det.loop.close()


def main() -> None:
    args = parse()
    ignored = drop_batchline_env()  # BATCHLINE_REDIS_URL included: its own redis-server
    print(header(), flush=True)
    if ignored:
        print(f"ignored from the environment: {', '.join(ignored)}", flush=True)
    apply_threads(available_cpus())
    torch.manual_seed(0)
    redis = None
    if args.stream_ab or not args.skip_redis:  # loaded before any timing
        server = redis_server(args.redis_server)
        redis = RedisWorker(args.max_running, args.device, args.dtype, args.model_path, server)
    try:
        if redis is not None and args.stream_ab:
            stream_ab(redis, 8 if args.quick else 32, 16 if args.quick else 32, args.rounds)
        else:
            measure(args, redis)
    finally:
        if redis is not None:
            redis.close()


if __name__ == "__main__":
    main()
