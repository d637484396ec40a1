"""What the thread driver (``batchline.dynamically``, called with ``acall``) and the asyncio
driver (``batchline.aio.dynamically``) promise alike: each test runs on both, through the
public API. A batch function held by a gate lets a test queue calls while the function is
busy, so that what the worker sees next is known."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import pytest

import batchline
import batchline.aio
from batchline import BatchlineError, RequestTimeout
from batchline.core.policy import BatchPolicy

from tests.support.driver_helpers import WAIT_S, Gate

DRIVERS = [
    pytest.param(batchline.dynamically, id="threads"),
    pytest.param(batchline.aio.dynamically, id="asyncio"),
]


def awaitable(f: Any) -> Callable[..., Any]:
    """The batcher's awaitable call: ``acall`` of a thread batcher, the asyncio one itself."""
    return f.acall if isinstance(f, batchline.ThreadBatcher) else f


def held_lengths(gate: Gate, dynamically: Any) -> Callable[[list[str]], Any]:
    """A batch function of lengths that holds its call of ``["hold"]`` at the gate, and
    with it the worker: a plain function for the thread driver, a coroutine function for
    the asyncio one (whose worker awaits it, rather than handing it to a thread)."""

    def lengths(xs: list[str]) -> list[int]:
        if xs == ["hold"]:
            gate.hold()
        return [len(x) for x in xs]

    async def alengths(xs: list[str]) -> list[int]:
        return await asyncio.to_thread(lengths, xs)

    return lengths if dynamically is batchline.dynamically else alengths


async def hold(f: Any, gate: Gate) -> asyncio.Future[Any]:
    """Call ``f("hold")``; return once the function holds it (its result: 4)."""
    first = asyncio.ensure_future(awaitable(f)("hold"))
    await asyncio.to_thread(gate.wait_entered)
    return first


async def while_held(f: Any, gate: Gate, calls: list[Any]) -> list[Any]:
    """Queue ``calls`` (items) while the function is held, then open the gate: the outcome
    of each call, in order (each call waits at most WAIT_S)."""
    call = awaitable(f)
    first = await hold(f, gate)
    tasks = [asyncio.ensure_future(call(x, timeout_s=WAIT_S)) for x in calls]
    await asyncio.sleep(0)  # each task's first step queues its item (or is refused)
    gate.release.set()
    assert await first == 4
    return await asyncio.gather(*tasks, return_exceptions=True)


# -- a bad length, a failing policy ------------------------------------------------------------


@pytest.mark.parametrize("dynamically", DRIVERS)
async def test_a_bad_length_fails_only_its_caller(dynamically: Any, gate: Gate) -> None:
    f = dynamically(batch_size=2, timeout_ms=0, length_fn=lambda s: len(s) or None)(
        held_lengths(gate, dynamically)
    )
    # Four calls wait together: more than a batch, so the worker groups them by length.
    outcomes = await while_held(f, gate, ["a", "bb", "", "ccc"])
    assert [outcomes[i] for i in (0, 1, 3)] == [1, 2, 3]
    assert isinstance(outcomes[2], TypeError)
    assert "length_fn must return a number" in str(outcomes[2])
    assert f.stats.rejected == 1, "refused before it was queued"
    assert await awaitable(f)("dddd", timeout_s=WAIT_S) == 4, "the worker lives on"
    await f.aclose()


@pytest.mark.parametrize("dynamically", DRIVERS)
@pytest.mark.parametrize("length", [-1, float("nan"), float("inf"), "3", True])
async def test_a_length_that_is_no_count_is_refused(dynamically: Any, length: Any) -> None:
    f = dynamically(timeout_ms=0, length_fn=lambda s: length)(lambda xs: xs)
    with pytest.raises((TypeError, ValueError), match="length_fn must return"):
        await awaitable(f)("x", timeout_s=WAIT_S)
    await f.aclose()


@pytest.mark.parametrize("dynamically", DRIVERS)
async def test_a_failing_policy_fails_the_callers_it_held_not_the_worker(
    dynamically: Any, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = dynamically(batch_size=2, timeout_ms=0)(held_lengths(gate, dynamically))
    poll = BatchPolicy.poll
    failures = [RuntimeError("a bug in the policy")]

    def failing_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        if failures and len(self) == 2:  # once both calls below wait
            raise failures.pop()
        return poll(self, *args, **kwargs)

    monkeypatch.setattr(BatchPolicy, "poll", failing_once)
    outcomes = await while_held(f, gate, ["a", "bb"])
    assert not failures, "the policy failed"
    for outcome in outcomes:
        assert isinstance(outcome, BatchlineError)
        assert isinstance(outcome.__cause__, RuntimeError)
    assert await awaitable(f)("ccc", timeout_s=WAIT_S) == 3, "the worker lives on"
    await f.aclose()


# -- timeouts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dynamically", DRIVERS)
@pytest.mark.parametrize("bound", ["timeout_s", "deadline"])
async def test_the_functions_own_timeout_error_reaches_its_caller(
    dynamically: Any, bound: str
) -> None:
    raised: list[TimeoutError] = []

    def backend(xs: list[int]) -> list[int]:
        raised.append(TimeoutError("backend"))
        raise raised[-1]

    f = dynamically(timeout_ms=0)(backend)
    far = {"timeout_s": WAIT_S, "deadline": time.monotonic() + WAIT_S}[bound]
    async with asyncio.timeout(WAIT_S / 2):  # at once: not at the call's deadline
        with pytest.raises(TimeoutError) as info:
            await awaitable(f)(1, **{bound: far})
    assert info.value is raised[-1], "unchanged, not a RequestTimeout of the call"
    assert not isinstance(info.value, RequestTimeout)
    await f.aclose()


@pytest.mark.parametrize("dynamically", DRIVERS)
@pytest.mark.parametrize(
    "bound",
    [{"timeout_s": math.inf}, {"timeout_s": 1e10}, {"deadline": math.inf}],
    ids=["timeout_s=inf", "timeout_s=1e10", "deadline=inf"],
)
async def test_a_bound_too_far_for_a_lock_is_no_bound(
    dynamically: Any, bound: dict[str, float]
) -> None:
    f = dynamically(timeout_ms=0)(lambda xs: [x * 2 for x in xs])
    assert await awaitable(f)(7, **bound) == 14
    if isinstance(f, batchline.ThreadBatcher):  # the sync call waits on a lock
        assert await asyncio.to_thread(f, 8, **bound) == 16
        f.close(timeout_s=bound.get("timeout_s", math.inf))
    assert f.stats.errors == 0
    await f.aclose()


@pytest.mark.parametrize("dynamically", DRIVERS)
@pytest.mark.parametrize(
    "bound", [{"timeout_s": math.nan}, {"deadline": math.nan}, {"timeout_s": -1.0}]
)
async def test_a_bound_that_is_no_time_is_a_value_error_for_its_caller(
    dynamically: Any, bound: dict[str, float]
) -> None:
    f = dynamically(timeout_ms=0)(lambda xs: [x * 2 for x in xs])
    with pytest.raises(ValueError, match="timeout_s|deadline"):
        await awaitable(f)(7, **bound)
    if isinstance(f, batchline.ThreadBatcher):
        with pytest.raises(ValueError, match="timeout_s|deadline"):
            await asyncio.to_thread(f, 8, **bound)
    assert await awaitable(f)(9) == 18, "the batcher serves the next call"
    assert f.stats.errors == 0
    await f.aclose()


@pytest.mark.parametrize("dynamically", DRIVERS)
async def test_calls_given_up_at_their_deadline_count_as_expired(
    dynamically: Any, gate: Gate
) -> None:
    f = dynamically(batch_size=1, timeout_ms=0)(held_lengths(gate, dynamically))
    first = await hold(f, gate)
    # The worker waits for the held function: each caller notices its deadline first.
    for x in ["a", "bb", "ccc"]:
        with pytest.raises(RequestTimeout):
            await awaitable(f)(x, timeout_s=0.05)
    gate.release.set()
    assert await first == 4
    assert await awaitable(f)("dddd", timeout_s=WAIT_S) == 4, "the three never ran"
    stats = f.stats
    assert (stats.expired, stats.errors, stats.items) == (3, 3, 2)
    await f.aclose()
