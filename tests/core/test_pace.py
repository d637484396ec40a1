"""The pace: when a plain batch function may run on the event loop itself."""

from __future__ import annotations

import pytest

from batchline.core.pace import Pace


def test_inline_after_a_streak_of_quick_calls() -> None:
    pace = Pace(inline_below_s=1e-3, streak=3)
    assert not pace.inline
    for _ in range(2):
        pace.observe(1e-4)
        assert not pace.inline
    pace.observe(1e-4)
    assert pace.inline


def test_one_slow_call_restarts_the_streak() -> None:
    pace = Pace(inline_below_s=1e-3, streak=2)
    pace.observe(0.0)
    pace.observe(0.0)
    assert pace.inline
    pace.observe(1e-3)  # at the bound is not quick
    assert not pace.inline
    pace.observe(0.0)
    assert not pace.inline
    pace.observe(0.0)
    assert pace.inline


def test_a_zero_bound_never_runs_inline() -> None:
    pace = Pace(inline_below_s=0.0, streak=1)
    for _ in range(100):
        pace.observe(0.0)
    assert not pace.inline


@pytest.mark.parametrize(("bound", "streak"), [(-1.0, 1), (float("nan"), 1), (1e-3, 0)])
def test_settings_are_checked(bound: float, streak: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        Pace(bound, streak)
