"""Sequences with the same prompt joining together (a request's ``n`` choices) share its
prefill: one row, forked after the prompt is in."""

from __future__ import annotations

from typing import Any

import pytest

from batchline.generation import Engine, GenerationParams
from batchline.generation._types import Sequence_

from tests.generation.test_engine import forward_widths
from tests.support.tiny import alone, tiny_model, torch


def request(prompt: list[int], **params: Any) -> Sequence_:
    return Sequence_(prompt, GenerationParams(**params), 0.0, lambda _: None)


def drain(engine: Engine) -> None:
    while engine.running:
        engine.step([])


def sampled_alone(model: Any, prompt: list[int], seed: int) -> list[int]:
    engine = Engine(model)
    seq = request(prompt, max_new_tokens=6, temperature=1.0, seed=seed)
    engine.step([seq])
    drain(engine)
    return seq.generated


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_same_prompt_joining_together_is_prefilled_once_and_each_decodes_its_own(
    kind: str,
) -> None:
    model = tiny_model(kind, torch.float64)
    widths = forward_widths(model)
    prompt = [5, 9, 11, 40, 7]
    greedy = [request(prompt, max_new_tokens=6) for _ in range(3)]
    seeded = [request(prompt, max_new_tokens=6, temperature=1.0, seed=s) for s in (1, 2)]
    other = request([8, 8], max_new_tokens=6)
    engine = Engine(model, prefix_cache_tokens=0)
    engine.step([*greedy, other, *seeded])
    assert widths == [(2, 5)]  # one prefill forward: the shared prompt once, the other beside
    assert len(engine.running) == 6
    drain(engine)
    assert all(s.generated == alone(model, prompt, 6) for s in greedy)  # equal, as OpenAI's
    assert other.generated == alone(model, [8, 8], 6)
    for seq, seed in zip(seeded, (1, 2), strict=True):
        assert seq.generated == sampled_alone(model, prompt, seed)  # its own random draws
    assert seeded[0].generated != seeded[1].generated


def test_twins_of_a_long_prompt_share_its_chunks_and_one_cancelled_leaves_the_others() -> None:
    model = tiny_model("llama", torch.float64)
    widths = forward_widths(model)
    prompt = [9 + i % 50 for i in range(20)]
    twins = [request(prompt, max_new_tokens=4) for _ in range(3)]
    engine = Engine(model, max_prefill_tokens=8, prefix_cache_tokens=0)
    engine.step(twins)
    assert widths == [(1, 8)]  # one row, a chunk
    assert engine.running == twins
    engine.evict([twins[0]])  # the row's own sequence leaves: a twin takes its row
    while not twins[1].generated:
        engine.step([])
    assert widths == [(1, 8), (1, 8), (1, 4)]
    assert engine.running == twins[1:]
    drain(engine)
    assert twins[0].generated == []
    assert twins[1].generated == twins[2].generated == alone(model, prompt, 4)


def test_a_prompt_whose_prefill_raises_fails_each_of_its_twins_alone() -> None:
    model = tiny_model("gpt2", torch.float64)
    bad_prompt = [13, 14]
    engine = Engine(model)
    forward = engine._forward

    def failing(ids: Any, *args: Any) -> Any:
        if ids.shape[1] > 1 and (ids == 13).any():  # the prefill of bad_prompt
            raise RuntimeError("this prompt breaks the model")
        return forward(ids, *args)

    engine._forward = failing  # type: ignore[method-assign]
    bad = [request(bad_prompt, max_new_tokens=3) for _ in range(2)]
    good = request([5, 6], max_new_tokens=3)
    out = engine.step([bad[0], good, bad[1]])
    assert sorted(id(s) for s, _ in out.failed) == sorted(id(s) for s in bad)
    assert engine.running == [good]
    drain(engine)
    assert good.generated == alone(model, [5, 6], 3)
