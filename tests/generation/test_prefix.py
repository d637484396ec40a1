"""The shared-prefix cache: a prompt that reuses a cached prefix generates exactly what it
would have without (float64, GPT-2 and Llama), and the cache keeps within its bound."""

from __future__ import annotations

import random
from typing import Any

import pytest

from batchline.core.scheduler import SchedulerConfig
from batchline.generation import Engine, GenerationParams, GenerationResult
from batchline.generation._prefix import PrefixCache
from batchline.generation._types import Sequence_

from tests.support.stepping import Plan, final, run_plan
from tests.support.tiny import VOCAB, alone, needs_cuda, tiny_model, torch

CONFIG = SchedulerConfig(max_batch_size=6, max_batch_tokens=600)


def shared_plan(seed: int, n: int = 24) -> Plan:
    """Requests over time: most start with one of two "system prompts" (one a prefix of the
    other's first half), some with none; a few repeat a whole earlier prompt, or are a
    system prompt alone, or part of one."""
    rnd = random.Random(seed)
    system = [rnd.randrange(4, VOCAB) for _ in range(14)]
    systems = [system, system[:6] + [rnd.randrange(4, VOCAB) for _ in range(9)]]
    plan: Plan = []
    for i in range(n):
        kind = rnd.random()
        if kind < 0.15 or not plan:
            prompt = [rnd.randrange(4, VOCAB) for _ in range(rnd.randint(1, 20))]
        elif kind < 0.25:
            prompt = list(plan[rnd.randrange(len(plan))][1])  # a repeat
        elif kind < 0.32:
            prompt = rnd.choice(systems)[: rnd.randint(1, 14)]  # within a cached run
        else:
            user = [rnd.randrange(4, VOCAB) for _ in range(rnd.randint(1, 18))]
            prompt = rnd.choice(systems) + user
        plan.append((i // 2 + rnd.randint(0, 3), prompt, rnd.randint(1, 12)))
    return plan


def generated(model: Any, plan: Plan, **engine: Any) -> tuple[list[list[int]], Engine]:
    built = Engine(model, **engine)
    got = []
    for events in run_plan(built, plan, CONFIG):
        result = final(events)
        assert isinstance(result, GenerationResult), result
        got.append(list(result.token_ids))
    return got, built


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("max_prefill_tokens", [512, 8])
@pytest.mark.slow
def test_reusing_cached_prefixes_generates_what_each_request_does_alone_float64(
    kind: str, max_prefill_tokens: int
) -> None:
    model = tiny_model(kind, torch.float64)
    for seed in range(2):
        plan = shared_plan(seed)
        got, engine = generated(model, plan, max_prefill_tokens=max_prefill_tokens)
        without, off = generated(
            model, plan, max_prefill_tokens=max_prefill_tokens, prefix_cache_tokens=0
        )
        assert engine.prefixes is not None
        assert off.prefixes is None
        # Most requests took a prefix from the cache, and the tokens are the same as without.
        assert engine.prefixes.hits >= len(plan) // 2
        assert engine.prefixes.reused_tokens >= 6 * len(plan) // 2
        assert got == without
        assert got == [alone(model, prompt, new) for _, prompt, new in plan]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_group_with_and_without_cached_prefixes_in_one_prefill(kind: str) -> None:
    """Rows reusing prefixes of different lengths, a row reusing none, and a row whose
    whole prompt is cached (it feeds its last token alone) join in one step."""
    model = tiny_model(kind, torch.float64)
    engine = Engine(model, prefix_cache_tokens=64)
    system = [10 + i for i in range(12)]
    first = Sequence_([*system, 50, 51], GenerationParams(max_new_tokens=4), 0.0, print)
    engine.step([first])
    prompts = [
        [*system, 60, 61, 62, 63, 64, 65, 66],  # the system prompt, then 7 more
        [*system[:5], 70],  # part of it
        [80, 81, 82],  # nothing cached
        [*system, 50, 51],  # the whole of a cached prompt
        [*system, 50],  # within it, ending before its end
    ]
    seqs = [Sequence_(p, GenerationParams(max_new_tokens=6), 0.0, print) for p in prompts]
    engine.step(seqs)
    assert engine.prefixes is not None
    assert engine.prefixes.reused_tokens == 12 + 5 + 13 + 12
    while engine.running:
        engine.step([])
    assert first.generated == alone(model, first.prompt_ids, 4)
    assert [s.generated for s in seqs] == [alone(model, p, 6) for p in prompts]


def kv_tokens(cache: PrefixCache) -> int:
    """Tokens the tree's tensors hold, counted from the tensors themselves."""
    total, stack = 0, list(cache._root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        assert all(k.shape[1] == v.shape[1] == len(node.tokens) for k, v in node.kv)
        assert all(k._base is None and v._base is None for k, v in node.kv)  # no views
        total += len(node.tokens)
    return total


def fake_kv(ids: list[int]) -> Any:
    """KV whose every column is its token id: what a lookup returns shows where it came from."""

    def kv_of(start: int, end: int) -> Any:
        column = torch.tensor(ids[start:end], dtype=torch.float64)
        return [(column[None, :, None].clone(), -column[None, :, None].clone())]

    return kv_of


def test_the_cache_stays_within_its_bound_and_evicts_the_least_recently_used_branch() -> None:
    cache = PrefixCache(40)
    system = list(range(100, 120))  # 20 tokens every prompt starts with
    rnd = random.Random(3)
    for i in range(30):
        prompt = [*system, *(rnd.randrange(4, 90) for _ in range(rnd.randint(1, 15)))]
        n, kv = cache.match(prompt)
        if i:
            assert n >= 20  # the shared prefix is never evicted: every prompt touches it
            assert kv is not None
            assert kv[0][0][0, :, 0].tolist() == prompt[:n]
        cache.insert(prompt, fake_kv(prompt))
        assert cache.tokens <= 40
        assert kv_tokens(cache) == cache.tokens
    # The most recent prompt is whole; the oldest branches went.
    n, _ = cache.match([*prompt, 1])
    assert n == len(prompt)


def test_a_prompt_longer_than_the_bound_caches_its_first_tokens_only() -> None:
    cache = PrefixCache(8)
    prompt = list(range(4, 24))
    asked: list[tuple[int, int]] = []

    def kv_of(start: int, end: int) -> Any:
        asked.append((start, end))
        return fake_kv(prompt)(start, end)

    cache.insert(prompt, kv_of)
    assert asked == [(0, 8)]  # never more than it keeps
    assert cache.tokens == kv_tokens(cache) == 8
    assert cache.match(prompt)[0] == 8
    cache.insert(prompt, kv_of)
    assert asked == [(0, 8)]  # what is held is not asked again


def test_splitting_a_cached_run_copies_both_halves() -> None:
    cache = PrefixCache(100)
    a, b = [5, 6, 7, 8, 9, 10], [5, 6, 7, 20, 21]
    cache.insert(a, fake_kv(a))
    cache.insert(b, fake_kv(b))
    assert cache.tokens == kv_tokens(cache) == 8
    for prompt in (a, b, [5, 6, 7, 8, 30]):
        n, kv = cache.match(prompt)
        assert kv is not None
        assert kv[0][0][0, :, 0].tolist() == prompt[:n]
        assert kv[0][1][0, :, 0].tolist() == [-t for t in prompt[:n]]
    assert [cache.match(p)[0] for p in (a, b, [5, 6, 7, 8, 30], [5], [6, 5])] == [5, 4, 4, 0, 0]


def test_engine_cache_keeps_within_its_bound_in_bytes() -> None:
    model = tiny_model("llama", torch.float64)
    engine = Engine(model, prefix_cache_tokens=30)
    rnd = random.Random(5)
    for _ in range(12):
        prompt = [7, 8, 9, *(rnd.randrange(4, VOCAB) for _ in range(rnd.randint(4, 16)))]
        engine.step([Sequence_(prompt, GenerationParams(max_new_tokens=2), 0.0, print)])
    assert engine.prefixes is not None
    assert 0 < engine.prefixes.tokens <= 30
    # 2 layers x (keys + values) x 2 KV heads x head dim 8 x 8 bytes a token.
    held = 0
    stack = list(engine.prefixes._root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        held += sum(k.nbytes + v.nbytes for k, v in node.kv)
    assert held == engine.prefixes.tokens * 2 * 2 * 2 * 8 * 8


CUDA = needs_cuda("cached prefixes kept on the GPU, in float16")


@pytest.mark.parametrize(
    ("device", "dtype"),
    [("cpu", "float32"), ("cpu", "bfloat16"), pytest.param("cuda", "float16", marks=CUDA)],
)
def test_cached_prefixes_live_on_the_models_device_in_its_dtype(device: str, dtype: str) -> None:
    model = tiny_model("llama", getattr(torch, dtype)).to(device)
    engine = Engine(model)
    a = Sequence_([5, 6, 7, 8, 9], GenerationParams(max_new_tokens=3), 0.0, print)
    b = Sequence_([5, 6, 7, 8, 10], GenerationParams(max_new_tokens=3), 0.0, print)
    engine.step([a])
    engine.step([b])
    assert engine.prefixes is not None
    assert engine.prefixes.reused_tokens == 4
    stack = list(engine.prefixes._root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        for t in (t for kv in node.kv for t in kv):
            assert (t.dtype, t.device.type, t.is_inference()) == (model.dtype, device, True)
    while engine.running:
        engine.step([])
    assert b.generated == alone(model, b.prompt_ids, 3)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_prefix_cache_tokens_is_validated(bad: Any) -> None:
    with pytest.raises(ValueError, match="prefix_cache_tokens must be an int >= 0"):
        Engine(tiny_model("gpt2"), prefix_cache_tokens=bad)


def test_reset_drops_the_cached_prefixes() -> None:
    engine = Engine(tiny_model("gpt2"))
    engine.step([Sequence_([5, 6, 7], GenerationParams(max_new_tokens=3), 0.0, print)])
    assert engine.prefixes is not None
    assert engine.prefixes.tokens == 3
    engine.reset()
    assert engine.prefixes.tokens == 0
    assert engine.prefixes.match([5, 6, 7, 8]) == (0, None)
