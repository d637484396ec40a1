"""Log probabilities of generated tokens (a request's ``logprobs``), from the engine's logits."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from batchline.errors import BadGenerationParams
from batchline.generation import Engine, GenerationParams
from batchline.generation._engine import StepOutput
from batchline.generation._logprobs import NO_CHANCE
from batchline.generation._request import parse_request
from batchline.generation._types import GenerationDelta, GenerationResult, Sequence_

from tests.support.models_for_tests import char_tokenizer
from tests.support.tiny import VOCAB, tiny_model, torch


def request(prompt: list[int], events: list[Any], **params: Any) -> Sequence_:
    return Sequence_(prompt, GenerationParams(**params), 0.0, events.append)


def reference(model: Any, prompt: list[int], generated: list[int]) -> list[list[float]]:
    """Each generated token's distribution (log-softmax), from one forward of the whole
    sequence alone, no cache."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    start = len(prompt) - 1
    return logits[start : start + len(generated)].log_softmax(-1).tolist()  # type: ignore[no-any-return]


def step(engine: Engine, joining: list[Sequence_]) -> StepOutput:
    """One engine step whose deltas and results go to the sequences' events, as the loop's."""
    out = engine.step(joining)
    for seq, delta in out.deltas:
        seq.on_event(delta)
    for seq, reason in out.finished:
        seq.on_event(seq.result(reason, 0.0))
    return out


def drain(engine: Engine, joining: list[Sequence_]) -> None:
    step(engine, joining)
    while engine.running:
        step(engine, [])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_logprobs_under_continuous_batching_are_each_sequences_own(kind: str) -> None:
    model = tiny_model(kind, torch.float64)
    engine = Engine(model)
    rnd = random.Random(3)
    events: list[list[Any]] = [[] for _ in range(6)]
    seqs = [
        request(
            [rnd.randrange(4, VOCAB) for _ in range(rnd.randint(1, 12))],
            events[i],
            max_new_tokens=rnd.randint(2, 9),
            logprobs=[0, 1, 5, 20, 3, 2][i],
            **({"temperature": 1.0, "seed": i} if i % 2 else {}),
        )
        for i in range(6)
    ]
    step(engine, seqs[:3])  # the others join a running batch, at different steps
    step(engine, seqs[3:5])
    step(engine, [])
    drain(engine, seqs[5:])
    for seq, got in zip(seqs, events, strict=True):
        result = got[-1]
        assert isinstance(result, GenerationResult)
        assert result.logprobs is not None
        assert len(result.logprobs) == len(result.token_ids)
        want = reference(model, seq.prompt_ids, list(result.token_ids))
        k = seq.params.logprobs
        for entry, token, dist in zip(result.logprobs, result.token_ids, want, strict=True):
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(dist[token], abs=1e-9)
            ranked = sorted(range(VOCAB), key=lambda t: -dist[t])[:k]
            assert [t for t, _ in entry.top] == ranked
            assert [v for _, v in entry.top] == pytest.approx([dist[t] for t in ranked], abs=1e-9)
            if seq.params.greedy and k:
                assert entry.top[0][0] == token
        deltas = [e for e in got if isinstance(e, GenerationDelta)]
        assert tuple(x for d in deltas for x in d.logprobs) == result.logprobs


def test_a_request_that_asks_none_gets_none_and_costs_nothing_beside_one_that_does() -> None:
    engine = Engine(tiny_model("gpt2"))
    plain: list[Any] = []
    asked: list[Any] = []
    drain(engine, [request([5, 6], plain, max_new_tokens=4), request([5, 6], asked, logprobs=0)])
    assert plain[-1].logprobs is None
    assert all(d.logprobs == () for d in plain[:-1])
    assert asked[-1].logprobs
    assert all(e.top == () for e in asked[-1].logprobs)


def test_logprobs_are_the_models_distribution_before_a_grammar_masks_it() -> None:
    pytest.importorskip("llguidance")
    model = tiny_model("llama", torch.float64)
    engine = Engine(model, char_tokenizer())
    events: list[Any] = []
    grammar = parse_request(
        {"prompt": "x", "response_format": {"type": "json_object"}, "logprobs": 20}
    ).params
    seq = Sequence_([5, 6, 7], grammar, 0.0, events.append)
    drain(engine, [seq])
    result = events[-1]
    want = reference(model, seq.prompt_ids, list(result.token_ids))
    first = result.logprobs[0]
    assert first.logprob == pytest.approx(want[0][first.token_id], abs=1e-9)
    assert math.isfinite(first.logprob)
    assert first.logprob > NO_CHANCE
    # Unmasked: the likeliest tokens of a random model, not only those JSON may start with.
    assert [t for t, _ in first.top] == sorted(range(len(want[0])), key=lambda t: -want[0][t])[:20]


@pytest.mark.parametrize("value", [-1, 21, True, 2.0, "3"])
def test_logprobs_out_of_range_or_of_another_type_is_refused_naming_it(value: Any) -> None:
    with pytest.raises(BadGenerationParams, match="logprobs must be an integer in 0..20"):
        parse_request({"prompt": "x", "logprobs": value})


def test_a_sequence_that_fails_in_a_step_gets_no_logprob_and_the_others_theirs() -> None:
    model = tiny_model("gpt2", torch.float64)
    engine = Engine(model)
    good: list[Any] = []
    ok = request([5, 6], good, max_new_tokens=4, logprobs=2)
    broken = request([7, 8], [], max_new_tokens=4, temperature=1.0, logprobs=2)
    broken.rng = "not a generator"  # sampling with it raises
    out = step(engine, [ok, broken])
    assert [s for s, _ in out.failed] == [broken]
    assert broken.logprobs == []
    drain(engine, [])
    result = good[-1]
    want = reference(model, [5, 6], list(result.token_ids))
    assert [e.logprob for e in result.logprobs] == pytest.approx(
        [d[t] for d, t in zip(want, result.token_ids, strict=True)], abs=1e-9
    )
