"""``batchline.dynamically``, the thread driver: decorating and calling (options, lists,
``acall``, many threads at once), methods (one batcher per instance, freed with it), the
statistics, and the latency SLO mode; end to end through the public API."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading
import weakref
from typing import Any

import pytest

import batchline
from batchline import BatcherClosed, ThreadBatcher

from tests.support.driver_helpers import HUGE_MS, WAIT_S, concurrently, double

# -- decorating and calling ------------------------------------------------------------------


def test_bare_decorator(closing: list[Any]) -> None:
    @batchline.dynamically
    def f(xs: list[int]) -> list[int]:
        """Doubles."""
        return double(xs)

    closing.append(f)
    assert isinstance(f, ThreadBatcher)
    assert f.__name__ == "f"
    assert f.__doc__ == "Doubles."
    assert f(3) == 6
    assert f([1, 2, 3]) == [2, 4, 6]
    assert f([]) == []


def test_decorator_with_arguments(closing: list[Any]) -> None:
    @batchline.dynamically(batch_size=4, timeout_ms=1)
    def f(xs: list[int]) -> list[int]:
        return double(xs)

    closing.append(f)
    assert isinstance(f, ThreadBatcher)
    assert f(5) == 10
    assert "batch_size=4" in repr(f)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be an int >= 1, got 0"),
        ({"timeout_ms": -1}, ValueError, "timeout_ms must be a finite number >= 0"),
        ({"timeout_ms": float("inf")}, ValueError, "timeout_ms must be a finite number"),
        ({"timeout_ms": "5"}, TypeError, "timeout_ms must be a number"),
        ({"max_queue_size": 0}, ValueError, "max_queue_size must be an int >= 1"),
        ({"small_batch_threshold": -1}, ValueError, "small_batch_threshold must be"),
        ({"max_tokens": 10}, ValueError, "max_tokens needs length_fn"),
    ],
)
def test_bad_options_are_refused_at_decoration(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        batchline.dynamically(**options)


def test_a_long_list_is_spread_over_batches_in_order(closing: list[Any]) -> None:
    seen: list[int] = []

    @batchline.dynamically(batch_size=32, timeout_ms=0)
    def f(xs: list[int]) -> list[int]:
        seen.append(len(xs))
        return double(xs)

    closing.append(f)
    assert f(list(range(1000))) == [x * 2 for x in range(1000)]
    assert sum(seen) == 1000
    assert max(seen) <= 32
    assert len(seen) >= 32  # ceil(1000 / 32)
    stats = f.stats
    assert stats.items == 1000
    assert stats.calls == 1


async def test_acall(closing: list[Any]) -> None:
    f = batchline.dynamically(double)
    closing.append(f)
    assert await f.acall(4) == 8
    assert await f.acall([1, 2]) == [2, 4]
    assert await f.acall([]) == []
    results = await asyncio.gather(*(f.acall(i) for i in range(50)))
    assert results == [i * 2 for i in range(50)]


def test_lone_call_with_zero_timeout_returns(closing: list[Any]) -> None:
    f = batchline.dynamically(timeout_ms=0)(double)
    closing.append(f)
    for i in range(20):
        assert f(i) == 2 * i


def test_many_threads_at_once_all_get_their_own_results(closing: list[Any]) -> None:
    sizes: list[int] = []

    @batchline.dynamically(batch_size=8, timeout_ms=1)
    def f(xs: list[Any]) -> list[Any]:
        sizes.append(len(xs))
        return [(x, threading.get_ident()) for x in xs]

    closing.append(f)
    args: list[Any] = [i if i % 3 else [i, i + 1000] for i in range(32)]
    futures = concurrently(f, args)
    for arg, fut in zip(args, futures, strict=True):
        got = fut.result()
        if isinstance(arg, list):
            assert [x for x, _ in got] == arg
        else:
            assert got[0] == arg
    assert max(sizes) <= 8
    assert sum(sizes) == sum(len(a) if isinstance(a, list) else 1 for a in args)


# -- methods ---------------------------------------------------------------------------------


class Model:
    def __init__(self, name: str) -> None:
        self.name = name
        self.threads: list[threading.Thread] = []

    @batchline.dynamically(timeout_ms=0)
    def predict(self, xs: list[int]) -> list[tuple[str, int]]:
        self.threads.append(threading.current_thread())
        return [(self.name, x) for x in xs]


class SlottedModel:
    __slots__ = ("__weakref__", "name")

    def __init__(self, name: str) -> None:
        self.name = name

    @batchline.dynamically(timeout_ms=0)
    def predict(self, xs: list[int]) -> list[tuple[str, int]]:
        return [(self.name, x) for x in xs]


@dataclasses.dataclass(slots=True, weakref_slot=True)
class SlottedDataclassModel:  # no __dict__, and unhashable (eq=True): kept by id
    name: str

    @batchline.dynamically(timeout_ms=0)
    def predict(self, xs: list[int]) -> list[tuple[str, int]]:
        return [(self.name, x) for x in xs]


@pytest.mark.parametrize("cls", [Model, SlottedModel, SlottedDataclassModel])
def test_methods_get_one_batcher_per_instance(cls: type[Any]) -> None:
    a, b = cls("a"), cls("b")
    assert isinstance(cls.predict, ThreadBatcher)
    assert a.predict is a.predict
    assert a.predict is not b.predict
    assert a.predict(1) == ("a", 1)
    assert b.predict([1, 2]) == [("b", 1), ("b", 2)]
    assert a.predict.stats.items == 1
    assert b.predict.stats.items == 2
    assert cls.predict.stats.items == 0, "the class-level descriptor runs nothing itself"
    a.predict.close()
    b.predict.close()


def test_equal_instances_get_batchers_of_their_own() -> None:
    a, b = SlottedDataclassModel("same"), SlottedDataclassModel("same")
    assert a == b
    assert a.predict is not b.predict
    a.predict(1)
    assert (a.predict.stats.items, b.predict.stats.items) == (1, 0)
    ref = weakref.ref(a)
    del a
    gc.collect()
    assert ref() is None, "the batcher must not keep its instance alive"
    assert b.predict(2) == ("same", 2)
    b.predict.close()


def test_a_method_of_instances_without_weak_references_says_what_they_need() -> None:
    @dataclasses.dataclass(slots=True)
    class Unreferenceable:
        name: str

        @batchline.dynamically(timeout_ms=0)
        def predict(self, xs: list[int]) -> list[int]:
            return xs

    with pytest.raises(TypeError, match="weakref_slot=True"):
        Unreferenceable("x").predict(1)


def test_an_instance_is_freed_and_its_worker_exits() -> None:
    model = Model("m")
    bound = model.predict
    assert bound([1, 2]) == [("m", 1), ("m", 2)]
    other = Model("o")
    other.predict(0)
    worker = model.threads[0]
    assert worker is not other.threads[0], "each instance has its own worker"
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None, "the batcher must not keep its instance alive"
    worker.join(WAIT_S)
    assert not worker.is_alive()
    assert bound.closed
    with pytest.raises(BatcherClosed):
        bound(3)
    assert other.predict(5) == ("o", 5), "other instances are unaffected"
    other.predict.close()


# -- statistics ------------------------------------------------------------------------------


async def test_stats_count_items_batches_sizes_and_errors(closing: list[Any]) -> None:
    @batchline.dynamically(batch_size=4, timeout_ms=HUGE_MS)
    def f(xs: list[int]) -> list[int]:
        if -1 in xs:
            raise ValueError("negative")
        return double(xs)

    closing.append(f)
    assert await asyncio.gather(*(f.acall(i) for i in range(8))) == [i * 2 for i in range(8)]
    outcomes = await asyncio.gather(*(f.acall(i) for i in (-1, 20, 21, 22)), return_exceptions=True)
    assert isinstance(outcomes[0], ValueError)
    assert outcomes[1:] == [40, 42, 44]
    stats = f.stats
    assert stats.items == 12
    assert stats.batches == 3
    assert stats.mean_batch_size == 4.0
    assert dict(stats.batch_size_histogram) == {4: 3}
    assert stats.calls == 12
    assert stats.errors == 1
    assert stats.rejected == 0
    assert stats.queue_size == 0
    assert stats.latency_ms.samples == 12
    assert stats.queue_wait_ms.samples == 12
    assert stats.function_ms.samples >= 3
    assert stats.padding_efficiency is None


# -- the latency SLO mode --------------------------------------------------------------------


@pytest.mark.slow
def test_latency_slo_mode_chooses_its_settings_within_the_limits() -> None:
    @batchline.dynamically(batch_size=64, timeout_ms=20.0, target_p99_ms=10.0)
    def double(xs: list[int]) -> list[int]:
        return [2 * x for x in xs]

    assert double.stats.target_p99_ms == 10.0
    # Before any batch: the largest batch, no wait (until the function's time is known).
    assert (double.stats.batch_size, double.stats.timeout_ms) == (64, 0.0)
    assert [double(i) for i in range(200)] == [2 * i for i in range(200)]
    stats = double.stats
    # One call at a time: a 20 ms wait for company would break a 10 ms target; the
    # controller waits at most what the target leaves after twice the batch's time.
    assert stats.timeout_ms < 10.0
    assert 1 <= stats.batch_size <= 64
    double.close()


@pytest.mark.parametrize("bad", [0, -5.0, float("inf"), float("nan")])
def test_latency_slo_target_must_be_positive_and_finite(bad: float) -> None:
    with pytest.raises(ValueError, match="target_p99_ms"):
        batchline.dynamically(lambda xs: xs, target_p99_ms=bad)
    with pytest.raises(TypeError, match="target_p99_ms"):
        batchline.dynamically(lambda xs: xs, target_p99_ms="5")  # type: ignore[arg-type]
