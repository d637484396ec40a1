"""Failure isolation of one batch, with fake items and a fake batch function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from batchline.core.isolation import Isolation
from batchline.errors import BatcherClosed, BatchFunctionError

_UNSET = object()


class FakeItem:
    """Implements ``Settleable``; remembers how (and how often) it was settled."""

    def __init__(self, payload: Any) -> None:
        self.payload = payload
        self.value: Any = _UNSET
        self.error: BaseException | None = None
        self.settled = 0
        self.gone = False

    @property
    def cancelled(self) -> bool:
        return self.gone

    def resolve(self, value: Any) -> None:
        self.settled += 1
        self.value = value

    def reject(self, exc: BaseException) -> None:
        self.settled += 1
        self.error = exc


def run(
    items: list[FakeItem], fn: Callable[[list[Any]], Any], *, isolate: bool = True
) -> list[list[Any]]:
    """Drive an Isolation the way the drivers do; return the payloads of every call."""
    calls: list[list[Any]] = []
    iso = Isolation(items, isolate=isolate)
    while (payloads := iso.next()) is not None:
        calls.append(list(payloads))
        try:
            outputs = fn(payloads)
        except BaseException as exc:
            iso.failed(exc)
        else:
            iso.succeeded(outputs)
    assert len(iso.durations_s) == len(calls)
    return calls


def doubled(payloads: list[int]) -> list[int]:
    return [p * 2 for p in payloads]


def test_success_resolves_every_item_in_order() -> None:
    items = [FakeItem(i) for i in range(5)]
    calls = run(items, doubled)
    assert calls == [[0, 1, 2, 3, 4]]
    assert [it.value for it in items] == [0, 2, 4, 6, 8]
    assert all(it.settled == 1 and it.error is None for it in items)


def test_a_tuple_or_array_result_is_accepted() -> None:
    np = pytest.importorskip("numpy")
    items = [FakeItem(i) for i in range(3)]
    run(items, lambda ps: np.asarray(ps) + 1)
    assert [int(it.value) for it in items] == [1, 2, 3]
    items = [FakeItem(i) for i in range(2)]
    run(items, tuple)
    assert [it.value for it in items] == [0, 1]


def test_one_bad_item_among_eight_fails_only_that_item() -> None:
    items = [FakeItem(i) for i in range(8)]

    def fn(payloads: list[int]) -> list[int]:
        if 3 in payloads:
            raise ValueError("bad input 3")
        return doubled(payloads)

    calls = run(items, fn)
    # Halving down to the bad item: 1 + 2 x log2(8) calls, first halves first.
    assert calls == [
        [0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 2, 3],
        [0, 1],
        [2, 3],
        [2],
        [3],
        [4, 5, 6, 7],
    ]
    assert isinstance(items[3].error, ValueError)
    assert str(items[3].error) == "bad input 3"
    for i, it in enumerate(items):
        assert it.settled == 1
        if i != 3:
            assert it.error is None
            assert it.value == i * 2


def test_isolate_false_fails_the_whole_batch_in_one_call() -> None:
    items = [FakeItem(i) for i in range(8)]
    boom = ValueError("boom")

    def fn(payloads: list[int]) -> list[int]:
        raise boom

    calls = run(items, fn, isolate=False)
    assert len(calls) == 1
    assert all(it.error is boom and it.settled == 1 for it in items)


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ([1, 2], "returned 2 results for 3 inputs"),
        ([1, 2, 3, 4], "returned 4 results for 3 inputs"),
        (None, "returned NoneType, not a sequence of 3 results"),
        (42, "returned int, not a sequence of 3 results"),
    ],
)
def test_a_broken_result_rejects_all_without_retry(result: Any, message: str) -> None:
    items = [FakeItem(i) for i in range(3)]
    calls = run(items, lambda payloads: result)
    assert len(calls) == 1, "a broken contract is not an item's fault: no retry"
    for it in items:
        assert isinstance(it.error, BatchFunctionError)
        assert message in str(it.error)
        assert it.settled == 1


def test_a_batch_function_error_from_a_wrapper_is_not_retried() -> None:
    items = [FakeItem(i) for i in range(4)]

    def fn(payloads: list[int]) -> list[int]:
        raise BatchFunctionError("contract broken")

    calls = run(items, fn)
    assert len(calls) == 1
    assert all(isinstance(it.error, BatchFunctionError) for it in items)


@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt, GeneratorExit])
def test_a_base_exception_is_wrapped_chained_and_not_retried(
    exc_type: type[BaseException],
) -> None:
    items = [FakeItem(i) for i in range(4)]
    raised = exc_type("stop")

    def fn(payloads: list[int]) -> list[int]:
        raise raised

    calls = run(items, fn)
    assert len(calls) == 1
    for it in items:
        assert isinstance(it.error, BatchFunctionError)
        assert it.error.__cause__ is raised
        assert exc_type.__name__ in str(it.error)
        assert it.settled == 1


def test_cancelled_items_are_dropped_before_the_call() -> None:
    items = [FakeItem(i) for i in range(5)]
    items[1].gone = True
    items[4].gone = True
    calls = run(items, doubled)
    assert calls == [[0, 2, 3]]
    assert [it.value for it in (items[0], items[2], items[3])] == [0, 4, 6]
    assert items[1].settled == 0
    assert items[4].settled == 0


def test_items_cancelled_during_a_failing_call_are_dropped_from_the_retries() -> None:
    items = [FakeItem(i) for i in range(4)]

    def fn(payloads: list[int]) -> list[int]:
        if len(payloads) == 4:
            items[0].gone = True  # its caller leaves while the batch runs
            raise ValueError("bad batch")
        return doubled(payloads)

    calls = run(items, fn)
    assert calls == [[0, 1, 2, 3], [1], [2, 3]]
    assert items[0].settled == 0
    assert [it.value for it in items[1:]] == [2, 4, 6]


def test_all_cancelled_means_no_call() -> None:
    items = [FakeItem(i) for i in range(3)]
    for it in items:
        it.gone = True
    assert run(items, doubled) == []


def test_abort_rejects_everything_not_settled() -> None:
    items = [FakeItem(i) for i in range(4)]
    iso = Isolation(items)
    assert iso.next() == [0, 1, 2, 3]
    iso.failed(ValueError("split"))
    assert iso.next() == [0, 1]  # now "running" the first half
    reason = BatcherClosed("shutting down")
    iso.abort(reason)
    assert all(it.error is reason and it.settled == 1 for it in items)
    assert iso.next() is None


def test_abort_after_a_success_leaves_the_resolved_half_alone() -> None:
    items = [FakeItem(i) for i in range(4)]
    iso = Isolation(items)
    iso.next()
    iso.failed(ValueError("split"))
    iso.succeeded(doubled(iso.next() or []))
    iso.next()
    iso.abort(BatcherClosed("shutting down"))
    assert [it.value for it in items[:2]] == [0, 2]
    assert all(it.error is None for it in items[:2])
    assert all(isinstance(it.error, BatcherClosed) for it in items[2:])


class _SizedOnly:
    """Has a length but cannot be iterated: not a sequence of results."""

    def __len__(self) -> int:
        return 2


class _LyingLength:
    """Claims two results but yields one."""

    def __len__(self) -> int:
        return 2

    def __iter__(self) -> Any:
        return iter([1])


@pytest.mark.parametrize("result", [_SizedOnly(), _LyingLength()])
def test_a_result_that_cannot_be_read_as_a_sequence_rejects_all(result: Any) -> None:
    items = [FakeItem(i) for i in range(2)]
    calls = run(items, lambda payloads: result)
    assert len(calls) == 1
    assert all(isinstance(it.error, BatchFunctionError) and it.settled == 1 for it in items)
