"""Deterministic generation's check: each prompt generated alone, then inside random batches
with random neighbours and staggered arrivals, chunked prefill forced, the prefix cache
cold and warm; which answers (tokens and log probabilities) differ from alone."""

from __future__ import annotations

import random
from typing import Any

from batchline.core.scheduler import SchedulerConfig
from batchline.generation import Engine, GenerationParams
from batchline.generation._types import GenerationResult

from tests.support.stepping import run_plan

CONFIG = SchedulerConfig(max_batch_size=32, max_batch_tokens=1 << 20)

#: (name, max_prefill_tokens, prefix_cache_tokens, prompts prefilled before: warm cache)
VARIANTS = (
    ("batched", 512, 0, 0),
    ("chunked", 7, 0, 0),
    ("prefix cache cold, chunked", 11, 4096, 0),
    ("prefix cache warm, chunked", 5, 4096, 8),
)

Answer = tuple[tuple[int, ...], tuple[float, ...]]


def params(sampled: bool, new: int) -> Any:
    """The i-th prompt's parameters: greedy, or sampled with the prompt's own seed."""

    def of(i: int, _new: int) -> GenerationParams:
        if sampled:
            return GenerationParams(max_new_tokens=new, temperature=0.9, seed=1000 + i, logprobs=0)
        return GenerationParams(max_new_tokens=new, logprobs=0)

    return of


def answers(engine: Engine, plan: list[tuple[int, list[int]]], new: int, of: Any) -> list[Answer]:
    events = run_plan(engine, [(at, p, new) for at, p in plan], CONFIG, params=of, max_steps=5000)
    out = []
    for got in events:
        result = got[-1]
        if not isinstance(result, GenerationResult):
            raise AssertionError(f"a request ended with {result!r}")
        out.append((result.token_ids, tuple(t.logprob for t in result.logprobs or ())))
    return out


def differing(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    *,
    new: int,
    sampled: bool = False,
    seed: int = 0,
) -> dict[str, list[int]]:
    """For each variant, the prompts whose answer differs from the prompt's alone."""
    alone = []
    for i, prompt in enumerate(prompts):
        of = params(sampled, new)
        engine = Engine(model, tokenizer, prefix_cache_tokens=0)
        alone += answers(engine, [(0, prompt)], new, lambda _j, n, i=i: of(i, n))
    rng = random.Random(seed)
    found: dict[str, list[int]] = {}
    for name, chunk, cache, warm in VARIANTS:
        engine = Engine(model, tokenizer, max_prefill_tokens=chunk, prefix_cache_tokens=cache)
        if warm:
            answers(engine, [(0, p) for p in prompts[:warm]], 2, params(sampled, 2))
        found[name] = _batches(engine, prompts, alone, new, sampled, rng)
    return found


def _batches(
    engine: Engine,
    prompts: list[list[int]],
    alone: list[Answer],
    new: int,
    sampled: bool,
    rng: random.Random,
) -> list[int]:
    """Every prompt once, in random batches of 2-32 (the others random neighbours, also
    checked), arriving over the first 6 steps; the prompts whose answer differs."""
    order = rng.sample(range(len(prompts)), len(prompts))
    differ = []
    while order:
        size = min(len(order), rng.randint(2, 32))
        group, order = order[:size], order[size:]
        of = params(sampled, new)
        plan = [(rng.randrange(6), prompts[i]) for i in group]
        got = answers(engine, plan, new, lambda j, n, g=group: of(g[j], n))
        differ += [i for i, answer in zip(group, got, strict=True) if answer != alone[i]]
    return sorted(differ)
