"""Models loaded by demand and unloaded when idle (``load demand``, ``unload_idle_s``,
``memory_budget_mb``): loaded once on the first call that needs them, whichever thread asks;
never unloaded while a call runs; unloaded after their idle time, least recently used first
when the budget needs room; a failed load fails its call and is tried again on the next."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from batchline.worker.models import Prepared
from batchline.worker.models._lazy import LazyModel, ModelPool

torch = pytest.importorskip("torch")

loads: list[str] = []


class Fake:
    """A model whose weights (a Linear of ``size`` x 16 float32) exist once loaded."""

    heavy_preprocess = False
    pads = False

    def __init__(self, name: str, size: int = 64, fail: list[bool] | None = None) -> None:
        self.name, self.size, self.fail = name, size, fail
        self.model: Any = None

    def load(self) -> None:
        if self.fail:
            self.fail.pop()
            raise RuntimeError("no weights")
        loads.append(self.name)
        self.model = torch.nn.Linear(16, self.size, bias=False)

    def preprocess(self, value: Any) -> list[Prepared]:
        if self.model is None:
            raise RuntimeError("not loaded")
        return [Prepared(value, 1)]

    def infer(self, batch: list[Any]) -> list[Any]:
        if self.model is None:
            raise RuntimeError("not loaded")
        return [f"{self.name}:{x}" for x in batch]

    def postprocess(self, outputs: list[Any], value: Any) -> Any:
        return outputs[0]

    def facts(self) -> dict[str, Any]:
        return {"kind": "embedding", "dimensions": self.size}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lazy(name: str, *, clock: Clock, pool: ModelPool | None = None, **fake: Any) -> LazyModel:
    return LazyModel(
        lambda: Fake(name, **fake), name=name, demand=True, idle_s=10, pool=pool, clock=clock
    )


@pytest.fixture(autouse=True)
def _no_loads() -> None:
    loads.clear()


def test_a_model_by_demand_loads_on_its_first_request_once_and_unloads_when_idle() -> None:
    clock = Clock()
    model = lazy("a", clock=clock)
    model.load()  # the worker's start: nothing loads
    assert (model.state, loads, model.facts()) == ("unloaded", [], {})
    assert model.preprocess("x")[0].payload == "x"
    assert (model.state, loads) == ("loaded", ["a"])
    assert model.bytes == 64 * 16 * 4
    assert model.infer(["x"]) == ["a:x"]
    clock.now = 9.0
    assert not model.unload_if_idle()  # used at 0: idle 9 s of 10
    clock.now = 10.0
    assert model.unload_if_idle()
    assert model.state == "unloaded"
    assert model.facts() == {"kind": "embedding", "dimensions": 64}  # remembered
    assert model.infer(["y"]) == ["a:y"]  # loaded again
    assert loads == ["a", "a"]


def test_concurrent_first_requests_load_the_model_once() -> None:
    model = lazy("a", clock=Clock())
    go = threading.Barrier(8)

    def first() -> None:
        go.wait()
        model.preprocess("x")

    threads = [threading.Thread(target=first) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert loads == ["a"]


def test_a_model_is_never_unloaded_while_a_call_runs() -> None:
    clock = Clock()
    model = lazy("a", clock=clock)
    model.infer(["warm"])
    inside, release = threading.Event(), threading.Event()
    inner = model._inner  # noqa: SLF001

    def slow(batch: list[Any]) -> list[Any]:
        inside.set()
        release.wait()
        return batch

    inner.infer = slow
    t = threading.Thread(target=model.infer, args=(["x"],))
    t.start()
    inside.wait()
    clock.now = 100.0
    assert not model.unload_if_idle()  # a call runs
    assert not model.unload(reason="test")
    release.set()
    t.join()
    clock.now = 200.0
    assert model.unload_if_idle()


def test_a_coroutine_models_call_keeps_it_in_use_until_its_end() -> None:
    """An ``async def`` model's infer returns a coroutine, which runs after infer returned
    (on the worker's loop): the model is in use until that coroutine ends, not only while
    it is made."""
    clock = Clock()
    model = lazy("a", clock=clock)
    model.infer(["warm"])
    inner = model._inner  # noqa: SLF001
    release = asyncio.Event()

    async def slow(batch: list[Any]) -> list[Any]:
        await release.wait()
        return batch

    inner.infer = slow

    async def call() -> None:
        running = asyncio.ensure_future(model.infer(["x"]))
        await asyncio.sleep(0)  # it runs, and waits
        clock.now = 100.0
        assert not model.unload_if_idle()  # its call runs
        release.set()
        assert await running == ["x"]
        clock.now = 200.0
        assert model.unload_if_idle()

    asyncio.run(call())


def test_the_budget_unloads_the_least_recently_used_idle_models_first() -> None:
    clock = Clock()
    size = 64 * 16 * 4  # each model's weights
    pool = ModelPool(budget_bytes=2 * size)
    a, b, c = (lazy(n, clock=clock, pool=pool) for n in "abc")
    for t, model in enumerate((a, b)):
        clock.now = float(t)
        model.infer(["x"])
    clock.now = 2.0
    a.infer(["x"])  # a used after b: b is the least recently used
    clock.now = 3.0
    c.infer(["x"])  # a and b fill the budget: the least recently used goes for c
    assert [m.state for m in (a, b, c)] == ["loaded", "unloaded", "loaded"]
    clock.now = 4.0
    b.infer(["x"])  # b again: now a is the least recently used
    assert [m.state for m in (a, b, c)] == ["unloaded", "loaded", "loaded"]
    assert loads == ["a", "b", "c", "b"]


class Reserving(Fake):
    """A model that holds memory besides its weights once loaded (a KV cache budget)."""

    def reserved_bytes(self) -> int:
        return 3 * 64 * 16 * 4


def test_the_budget_counts_what_a_model_reserves_besides_its_weights() -> None:
    clock = Clock()
    size = 64 * 16 * 4
    pool = ModelPool(budget_bytes=4 * size)  # the weights of both fit; a's reserve too
    a = LazyModel(
        lambda: Reserving("a"), name="a", demand=True, idle_s=None, pool=pool, clock=clock
    )
    b = lazy("b", clock=clock, pool=pool)
    a.infer(["x"])
    assert (a.weights, a.bytes) == (size, 4 * size)
    clock.now = 1.0
    b.infer(["x"])  # a's weights and reserve, and b's weights: over the budget
    assert [m.state for m in (a, b)] == ["unloaded", "loaded"]


class Strict(Fake):
    """A model whose facts need its weights (a generation model's need its engine)."""

    def facts(self) -> dict[str, Any]:
        if self.model is None:
            raise RuntimeError("facts of a model not loaded")
        return super().facts()


def test_facts_read_during_an_unload_are_the_last_loaded_ones() -> None:
    """The heartbeat publishes facts on another thread than the unload: whenever it reads
    them (here: from the unload's own callback, after the model was swapped), it gets the
    loaded model's or the remembered ones, never asks a model that is not loaded."""
    model = LazyModel(lambda: Strict("a"), name="a", demand=True, idle_s=None, clock=Clock())
    model.infer(["x"])
    seen: list[dict[str, Any]] = []
    model.on_unload = lambda: seen.append(model.facts())
    assert model.unload(reason="a test")
    assert seen == [{"kind": "embedding", "dimensions": 64}]
    assert model.facts() == {"kind": "embedding", "dimensions": 64}


def test_a_failed_load_fails_its_call_and_the_next_call_loads() -> None:
    model = lazy("a", clock=Clock(), fail=[True])
    with pytest.raises(RuntimeError, match="no weights"):
        model.preprocess("x")
    assert model.state == "unloaded"
    assert model.infer(["x"]) == ["a:x"]


def test_a_load_by_demand_waits_for_the_other_queues_loads_at_start() -> None:
    """A request for a queue loaded by demand that comes while another queue of the process
    has not started yet waits, holding nothing: that queue's load at start comes first, and
    the demand load follows once it has started."""
    from batchline.worker.models._protocol import LOADING

    pool = ModelPool()
    pool.starting("demand", "warm")
    pool.started("demand")  # the queue loaded by demand has started (it loads nothing then)
    model = lazy("a", clock=Clock(), pool=pool)
    request = threading.Thread(target=model.preprocess, args=("x",))
    request.start()
    request.join(timeout=0.5)  # without the wait, it loads at once
    assert request.is_alive()
    assert (loads, model.state) == ([], "unloaded")
    assert LOADING.acquire(blocking=False)  # the other queue's load at start is not held back
    try:
        loads.append("warm")
    finally:
        LOADING.release()
    pool.started("warm")
    request.join(timeout=30)
    assert not request.is_alive()
    assert (loads, model.state) == (["warm", "a"], "loaded")
