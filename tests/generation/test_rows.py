"""A generation step that raises fails only the request that made it raise.

Hostile models: a tiny model whose forward raises when a poison token is fed (a prefill
culprit) or when a position only the culprit's long prompt reaches is fed (a decode-time
culprit), beside several innocent requests. The innocents' tokens must equal their tokens in
a run where the culprit never joined, and what each generates alone.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from batchline.core.scheduler import SchedulerConfig
from batchline.errors import GenerationError
from batchline.generation import Engine, GenerationLoop, GenerationParams, GenerationResult
from batchline.generation._types import Sequence_

from tests.support.stepping import Clock, Plan, final, run_plan
from tests.support.tiny import alone, tiny_model

POISON = 96
CONFIG = SchedulerConfig(max_batch_size=8, max_batch_tokens=4096)


class Hostile:
    """Makes ``model``'s forward raise on a poison token, past a position, or always; counts
    the forward passes and the rows they fed."""

    def __init__(
        self, model: Any, *, poison: int | None = None, max_position: int | None = None
    ) -> None:
        self.poison, self.max_position = poison, max_position
        self.always = False
        self.max_rows: int | None = None  # raise when a pass feeds more rows than this
        self.calls: list[int] = []  # rows fed by each pass
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        ids, pos = kwargs["input_ids"], kwargs["position_ids"]
        self.calls.append(ids.shape[0])
        if self.always:
            raise RuntimeError("the model is broken")
        if self.poison is not None and bool((ids == self.poison).any()):
            raise ValueError("poison token")
        if self.max_position is not None and int(pos.max()) >= self.max_position:
            raise IndexError(f"position {int(pos.max())} is out of range")
        if self.max_rows is not None and ids.shape[0] > self.max_rows:
            raise RuntimeError(f"{ids.shape[0]} rows at once")


INNOCENTS: Plan = [
    (0, [5, 6, 7], 20),
    (0, [8] * 12, 18),
    (0, [9, 10], 16),
    (1, [11] * 7, 20),
    (1, [12, 13, 14, 15], 17),
    (2, [16] * 5, 15),
]


def innocents_alone(model: Any) -> list[list[int]]:
    want = [alone(model, prompt, new) for _, prompt, new in INNOCENTS]
    assert all(POISON not in tokens for tokens in want)  # they never feed the poison
    return want


def tokens(events: list[Any]) -> list[int]:
    result = final(events)
    assert isinstance(result, GenerationResult), result
    return list(result.token_ids)


def check_run(model: Any, culprit: tuple[int, list[int], int], **engine: Any) -> list[Any]:
    """Run the innocents with the culprit joining at its step, and without it; the innocents
    must get the same tokens in both (and equal to alone); returns the culprit's events."""
    with_culprit = run_plan(Engine(model, **engine), [*INNOCENTS, culprit], CONFIG)
    without = run_plan(Engine(model, **engine), INNOCENTS, CONFIG)
    got = [tokens(events) for events in with_culprit[:-1]]
    assert got == [tokens(events) for events in without]
    assert got == innocents_alone(model)
    return with_culprit[-1]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.slow
def test_a_prefill_culprit_fails_alone_and_the_others_run_as_if_it_never_joined(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model(kind)
    hostile = Hostile(model, poison=POISON)
    # It joins at step 1 with another innocent beside it in its prefill group, while three
    # others decode.
    with caplog.at_level(logging.ERROR, "batchline.generation._engine"):
        events = check_run(model, (1, [20, POISON, 21], 10))
    assert len(events) == 1
    error = final(events)
    assert isinstance(error, GenerationError)
    assert str(error) == "ValueError: poison token"
    assert "for one request alone" in caplog.text
    assert max(hostile.calls) > 1  # it did share steps


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.slow
def test_a_decode_time_culprit_fails_alone_and_keeps_the_tokens_it_had(kind: str) -> None:
    """Only the culprit's long prompt reaches position 63: its 4th decode step raises."""
    model = tiny_model(kind)
    Hostile(model, max_position=63)
    events = check_run(model, (1, [30 + i % 40 for i in range(60)], 10))
    *deltas, error = events
    assert isinstance(error, GenerationError)
    assert str(error) == "IndexError: position 63 is out of range"
    assert len(deltas) == 4  # its prefill's token, then decode steps at positions 60, 61, 62


def test_a_culprit_in_a_chunked_prefill_fails_alone() -> None:
    model = tiny_model("llama")
    Hostile(model, poison=POISON)
    long = [40 + i % 30 for i in range(30)]
    culprit = (1, [*long[:20], POISON, *long[20:]], 5)  # the poison is in its 3rd chunk
    events = check_run(model, culprit, max_prefill_tokens=8)
    assert [type(e) for e in events] == [GenerationError]


@pytest.mark.slow
def test_a_failure_that_needs_the_whole_batch_fails_nobody() -> None:
    """More than 3 rows at once raises: the step is split, nobody is to blame."""
    model = tiny_model("llama")
    hostile = Hostile(model)
    hostile.max_rows = 3
    ran = run_plan(Engine(model), INNOCENTS, CONFIG)
    assert [tokens(events) for events in ran] == innocents_alone(model)
    assert max(hostile.calls) == 6  # the first try of each step, before the split


def test_a_failure_every_subset_raises_fails_each_request_alone_in_bounded_passes() -> None:
    model = tiny_model("llama")
    hostile = Hostile(model)
    clock = Clock()
    loop = GenerationLoop(Engine(model), CONFIG, clock=clock)
    events: list[list[Any]] = [[] for _ in range(6)]
    for i, got in enumerate(events):
        params = GenerationParams(max_new_tokens=9)
        loop.submit(Sequence_([5 + i] * (i + 1), params, 0, got.append))
    loop.run_once()  # all six join and get one token
    hostile.always = True
    hostile.calls.clear()
    loop.run_once()
    assert loop.idle
    assert len(hostile.calls) <= 2 * 6 - 1  # halves down to single rows, each tried once
    assert sorted(hostile.calls)[:6] == [1] * 6  # each failed alone
    for got in events:
        assert len(got) == 2
        assert isinstance(got[-1], GenerationError)
        assert str(got[-1]) == "RuntimeError: the model is broken"
    # The engine is not wedged: the next request runs.
    hostile.always = False
    after: list[Any] = []
    loop.submit(Sequence_([5, 6], GenerationParams(max_new_tokens=3), 0, after.append))
    while not loop.idle:
        loop.run_once()
    assert tokens(after) == alone(model, [5, 6], 3)


def test_the_cache_is_rewound_before_the_retry() -> None:
    """A decode step that raises in its second layer, after the first layer's cache grew:
    the retry must see the cache of before the step, not one column more."""
    model = tiny_model("llama")
    layer = model.model.layers[1]
    armed = {"on": False}

    def raise_once(_m: Any, _a: Any) -> None:
        if armed["on"]:
            armed["on"] = False
            raise RuntimeError("a transient failure")

    layer.register_forward_pre_hook(raise_once)
    engine = Engine(model)
    params = GenerationParams(max_new_tokens=8)
    seqs = [Sequence_([5 + i] * (3 + i), params, 0, [].append) for i in range(3)]
    engine.step(seqs)
    armed["on"] = True
    out = engine.step([])
    assert not out.failed
    while engine.running:
        engine.step([])
    for seq in seqs:
        assert seq.generated == alone(model, seq.prompt_ids, 8)


def test_a_failure_outside_the_model_fails_what_the_engine_held_with_a_log_line(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model("llama")
    engine = Engine(model)
    clock = Clock()
    loop = GenerationLoop(engine, CONFIG, clock=clock)
    events: list[list[Any]] = [[], [], []]
    loop.submit(Sequence_([5, 6], GenerationParams(max_new_tokens=9), 0, events[0].append))
    loop.run_once()
    loop.submit(Sequence_([7, 8], GenerationParams(max_new_tokens=9), 0, events[1].append))

    def broken(*_: Any) -> None:
        raise KeyError("a bug")

    monkeypatch.setattr(engine, "_join", broken)
    with caplog.at_level(logging.ERROR, "batchline.generation._loop"):
        loop.run_once()
    assert "failed outside the model; failing the 2 requests it held" in caplog.text
    for got in events[:2]:
        assert isinstance(got[-1], GenerationError)
        assert str(got[-1]) == "KeyError: 'a bug'"
    assert loop.idle
    assert not engine.running
    monkeypatch.undo()
    loop.submit(Sequence_([9, 10], GenerationParams(max_new_tokens=4), 0, events[2].append))
    while not loop.idle:
        loop.run_once()
    assert tokens(events[2]) == alone(model, [9, 10], 4)
