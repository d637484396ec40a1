"""Prefill time with the shared-prefix cache and without, on the chat workload.

``--requests`` chat requests (one user message each, no system message: SmolLM2's template
adds its default system prompt to every one) join an engine on SmolLM2-135M-Instruct
``--join`` at a time, each with ``max_new_tokens`` 1, so that each step is the prefill of
the requests joining and nothing else; the figure is the sum of those steps' seconds. The
engine has served one chat request before (untimed): a server's steady state, where the
system prompt is cached already. With the cache (``prefix_cache_tokens`` 2048) and without
(0), in the same process, alternating ``--repeats`` times, each repeat on a fresh engine;
reported: each way's median, the saving, the prompt tokens fed to the model, and whether the
first tokens agree. Then every request generates ``--new-tokens`` greedily both ways and the
token sequences are compared.

    HF_HUB_OFFLINE=1 python3 -m benchmarks.prefix --repeats 5

``--choices N`` measures instead what a route's ``n`` choices share: each of ``--requests``
prompts (of ``--prompt-tokens`` tokens) joins as N requests with that prompt, which the
engine prefills once and forks, against N requests whose prompts differ in their first
token (N prefills), the cache off both ways; alternating, ``--repeats`` times.

    HF_HUB_OFFLINE=1 python3 -m benchmarks.prefix --choices 4 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from batchline.worker._cpu_threads import (
    apply_threads,
    available_cpus,
    prepare_environment,
)

prepare_environment(available_cpus())  # before torch loads, as the worker does

import torch  # noqa: E402

from batchline.generation import Engine, GenerationParams, load_causal_lm  # noqa: E402
from batchline.generation._types import Sequence_  # noqa: E402
from benchmarks.harness import header  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one sentence.",
    "Write a haiku about rain.",
    "Why is the sky blue?",
    "What is a black hole?",
    "How do I boil an egg?",
    "Summarise the French revolution.",
    "What is a prime number?",
    "Describe the water cycle.",
    "What is machine learning?",
    "Suggest a good breakfast.",
    "Who landed on the moon first?",
    "How do volcanoes form?",
    "How do bees make honey?",
    "When did the Roman empire fall?",
    "What is gravity?",
]


def chats(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]


def engine(model: Any, tokenizer: Any, prefix_cache_tokens: int) -> Engine:
    built = Engine(model, tokenizer, prefix_cache_tokens=prefix_cache_tokens)
    warm = built.encode(messages=[{"role": "user", "content": "Hello!"}])
    run(built, [warm], join=1, new_tokens=1)  # a server that has answered one chat before
    return built


def run(built: Engine, prompts: list[list[int]], *, join: int, new_tokens: int) -> Any:
    """Each wave of ``join`` prompts joins, then steps until it is done; returns (prefill
    seconds, tokens fed, generated tokens of each prompt)."""
    seqs = [
        Sequence_(p, GenerationParams(max_new_tokens=new_tokens), 0.0, lambda _: None)
        for p in prompts
    ]
    prefill = 0.0
    reused = built.prefixes.reused_tokens if built.prefixes is not None else 0
    for i in range(0, len(seqs), join):
        start = time.perf_counter()
        built.step(seqs[i : i + join])
        prefill += time.perf_counter() - start
        while built.running:
            built.step([])
    if built.prefixes is not None:
        reused = built.prefixes.reused_tokens - reused
    fed = sum(len(p) for p in prompts) - reused
    return prefill, fed, [s.generated for s in seqs]


def forked(model: Any, tokenizer: Any, args: argparse.Namespace) -> None:
    """The ``--choices`` measure: the same prompt N times, against N different ones."""
    probe = Engine(model, tokenizer, prefix_cache_tokens=0)
    text = " ".join(QUESTIONS) * 8
    base = probe.encode(text)[: args.prompt_tokens]
    print(
        f"SmolLM2-135M-Instruct on {model.device} in {model.dtype}, {torch.get_num_threads()} "
        f"threads; {args.requests} prompts of {len(base)} tokens, each joining as "
        f"{args.choices} requests (a request's n choices)"
    )
    ways = {"same prompt (forked)": True, "distinct prompts": False}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    firsts: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        order = list(ways) if repeat % 2 == 0 else list(reversed(ways))
        for way in order:
            prompts = [
                [base[0] + (0 if ways[way] else c), *base[1:]]
                for r in range(args.requests)
                for c in range(args.choices)
            ]
            took, _, firsts[way] = run(
                Engine(model, tokenizer, prefix_cache_tokens=0),
                prompts,
                join=args.choices,
                new_tokens=1,
            )
            seconds[way].append(took)
    for way in ways:
        runs = " ".join(f"{s:.3f}" for s in seconds[way])
        print(f"{way:>20}: prefill {statistics.median(seconds[way]):.3f} s median ({runs})")
    one, apart = (statistics.median(seconds[way]) for way in ways)
    print(f"prefill time saved: {1 - one / apart:.1%} ({apart / one:.2f}x)")
    got, n = firsts[next(iter(ways))], args.choices
    same = all(len({tuple(x) for x in got[r * n : (r + 1) * n]}) == 1 for r in range(len(got) // n))
    print(f"forked choices' first tokens equal: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--join", type=int, default=4, help="requests joining a step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--choices", type=int, default=0, help="measure n choices' forks")
    parser.add_argument("--prompt-tokens", type=int, default=300, help="with --choices")
    args = parser.parse_args()
    print(header())
    apply_threads(available_cpus())
    model, tokenizer = load_causal_lm(device=args.device, dtype=args.dtype)
    if args.choices:
        forked(model, tokenizer, args)
        return
    probe = Engine(model, tokenizer, prefix_cache_tokens=0)
    prompts = [probe.encode(messages=m) for m in chats(args.requests)]
    shared = min(
        next((i for i, (x, y) in enumerate(zip(p, prompts[0], strict=False)) if x != y), len(p))
        for p in prompts[1:]
    )
    print(
        f"SmolLM2-135M-Instruct on {model.device} in {model.dtype}, {torch.get_num_threads()} "
        f"threads; {args.requests} chat requests, {args.join} joining a step; prompts of "
        f"{min(map(len, prompts))}..{max(map(len, prompts))} tokens, the first {shared} "
        "the same in all"
    )
    ways = {"cache": 2048, "no cache": 0}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    fed: dict[str, int] = {}
    firsts: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        order = list(ways) if repeat % 2 == 0 else list(reversed(ways))
        for way in order:
            took, fed[way], firsts[way] = run(
                engine(model, tokenizer, ways[way]), prompts, join=args.join, new_tokens=1
            )
            seconds[way].append(took)
    for way in ways:
        runs = " ".join(f"{s:.3f}" for s in seconds[way])
        print(
            f"{way:>8}: prefill {statistics.median(seconds[way]):.3f} s median ({runs}), "
            f"{fed[way]} prompt tokens fed"
        )
    with_, without = (statistics.median(seconds[way]) for way in ways)
    print(f"prefill time saved: {1 - with_ / without:.1%} ({without / with_:.2f}x)")
    print(f"first tokens the same: {firsts['cache'] == firsts['no cache']}")
    outs = {
        way: run(engine(model, tokenizer, n), prompts, join=args.join, new_tokens=args.new_tokens)[
            2
        ]
        for way, n in ways.items()
    }
    same = sum(a == b for a, b in zip(outs["cache"], outs["no cache"], strict=True))
    print(f"greedy {args.new_tokens} tokens, the same with and without: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
