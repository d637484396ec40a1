"""Driving a GenerationLoop step by step with a fake clock: one loop iteration per tick."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchline.core.scheduler import SchedulerConfig
from batchline.generation import Engine, GenerationLoop, GenerationParams
from batchline.generation._types import Sequence_

#: (the step it arrives at, prompt ids, max_new_tokens) of one request.
Plan = list[tuple[int, list[int], int]]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_plan(
    engine: Engine,
    plan: Plan,
    config: SchedulerConfig,
    *,
    max_steps: int = 1000,
    params: Callable[[int, int], GenerationParams] | None = None,
) -> list[list[Any]]:
    """Submit each request at its step, one loop iteration per step, until all have ended;
    each request's events (deltas, then its result or exception). ``params(i,
    max_new_tokens)``: the i-th request's parameters (default: greedy)."""
    clock = Clock()
    loop = GenerationLoop(engine, config, clock=clock)
    events: list[list[Any]] = [[] for _ in plan]
    last = max((at for at, _, _ in plan), default=0)
    for step in range(max_steps):
        clock.now = float(step)
        for i, ((at, prompt, new), got) in enumerate(zip(plan, events, strict=True)):
            if at == step:
                p = GenerationParams(max_new_tokens=new) if params is None else params(i, new)
                loop.submit(Sequence_(prompt, p, clock.now, got.append))
        loop.run_once()
        if step >= last and loop.idle:
            return events
    raise AssertionError(f"the loop did not drain in {max_steps} steps")


def final(events: list[Any]) -> Any:
    """The request's last event: its result, or the exception it ended with."""
    return events[-1]
