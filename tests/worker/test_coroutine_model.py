"""A coroutine model (an ``async def`` batch function) is called as a plain one is: its
warm-up batch and its calls run to their end on the worker's event loop while the caller's
thread waits, stamped, timed and holding the model's lock (no Redis: the executors and the
guard on their own). Its hang in a real worker: tests/e2e/test_containment.py."""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Sequence
from typing import Any

import pytest

from batchline.config import WorkerSettings
from batchline.drivers._aio import AioBatcher
from batchline.transport import CancelLog
from batchline.worker import Prepared
from batchline.worker.models import CallableModel
from batchline.worker.serving._executors import build
from batchline.worker.serving._starts import Starts
from batchline.worker.shared._guard import Guard, Stamp
from batchline.worker.shared._held import Claims

from tests.support.models_for_tests import NAP_S
from tests.support.service import spec


def _guard(**settings: Any) -> tuple[Guard, WorkerSettings, Claims]:
    s = WorkerSettings(model="x:y", **settings)
    claims = Claims(None, [], "w")
    return Guard(s, claims, workers_key="w", redis=None, own=False), s, claims


async def test_the_warm_up_batch_of_a_coroutine_model_times_its_own_call() -> None:
    model = CallableModel(spec("async_nap"))  # awaits NAP_S a call
    model.load()
    guard, _, _ = _guard(batch_size=4)
    guard.loop = asyncio.get_running_loop()  # as the worker sets it
    # As the worker measures at start: on a thread of its own, before it serves.
    await asyncio.to_thread(guard.measure, model, pads=False, padding=None)
    slowest = guard.bound.slowest()
    assert slowest is not None
    assert slowest[0] >= NAP_S  # the call itself, not the making of its coroutine
    assert slowest[1] == 4 * len("warm-up")


def test_a_coroutine_model_cannot_run_without_its_loop_nor_on_it() -> None:
    from batchline.worker.shared._guard import finish

    async def nap() -> None:
        await asyncio.sleep(0)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="no event loop"):
            finish(nap(), None)

        async def on_the_loop() -> None:
            with pytest.raises(RuntimeError, match="its own event loop's thread"):
                finish(nap(), asyncio.get_running_loop())

        asyncio.run(on_the_loop())
    assert finish([1, 2], None) == [1, 2]  # a plain model's outputs, as they are


class _Napping:
    """A Model whose ``infer`` is a coroutine function: it notes how many of its calls run at
    once and the guard's stamp while each runs."""

    heavy_preprocess = False
    pads = False

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.inside = 0
        self.most = 0
        self.stamps: list[Stamp | None] = []

    def load(self) -> None:
        return None

    def preprocess(self, value: Any) -> list[Prepared]:
        return [Prepared(value)]

    async def infer(self, batch: list[Any]) -> Sequence[Any]:
        self.inside += 1
        self.most = max(self.most, self.inside)
        self.stamps.append(self.guard.running)
        await asyncio.sleep(NAP_S)
        self.stamps.append(self.guard.running)
        self.inside -= 1
        return batch

    def postprocess(self, outputs: list[Any], value: Any) -> Any:
        return outputs[0]


async def test_a_coroutine_models_calls_are_stamped_timed_and_hold_the_models_lock() -> None:
    guard, settings, claims = _guard(batch_size=2, timeout_ms=0)
    guard.loop = asyncio.get_running_loop()
    model = _Napping(guard)
    starts = Starts(claims, CancelLog(settings.result_ttl_s), asyncio.Event())
    executors = build(model, settings, guard=guard, starts=starts)
    main, alone = executors.main, executors.alone
    assert isinstance(main, AioBatcher)
    assert isinstance(alone, AioBatcher)
    began = time.monotonic()
    # A batch and an entry run alone (a redelivery): the two batchers share the model's lock.
    outputs = await asyncio.gather(
        main([Prepared("a"), Prepared("b")]),
        alone([Prepared("c")]),
    )
    assert outputs == [["a", "b"], ["c"]]
    assert model.most == 1  # one call at a time, each held to its end
    assert time.monotonic() - began >= 2 * NAP_S
    # The guard's stamp held from each call's start to its end (each call its own stamp).
    assert all(stamp is not None for stamp in model.stamps)
    assert model.stamps[0] is model.stamps[1]
    assert model.stamps[2] is model.stamps[3]
    assert guard.running is None
    slowest = guard.bound.slowest()
    assert slowest is not None
    assert slowest[0] >= NAP_S  # timed into max_batch_ms auto
