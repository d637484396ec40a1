"""The bound of one model call (``max_batch_ms``) and the watchdog's view of a call, on their
own: timings given by hand, a fake clock ticking the watch (no threads, no Redis)."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchline.config import WorkerSettings
from batchline.worker import Prepared
from batchline.worker.shared._guard import (
    COLD_S,
    FACTOR,
    FLOOR_S,
    CallBound,
    Stamp,
    prime,
    read_timing,
    warm_up,
    work_of,
    write_timing,
)
from batchline.worker.upkeep._watchdog import CallWatch

TICK_S = 0.25


def run_call(watch: CallWatch, clock: list[float], seconds: float, work: float | None) -> str:
    """Tick ``watch`` through one call of ``seconds`` (the fake clock advances); the worst
    state it reported (``hung`` ends the call there)."""
    stamp: Stamp = (clock[0], work)
    end = clock[0] + seconds
    worst = "running"
    while clock[0] + TICK_S < end:
        clock[0] += TICK_S
        state = watch.tick(clock[0], stamp)
        if state == "hung":
            return state
        if state == "slow":
            worst = state
    clock[0] = end
    watch.tick(clock[0], None)
    return worst


def test_the_setting_is_auto_by_default_and_takes_a_number_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert WorkerSettings().max_batch_ms == "auto"
    monkeypatch.setenv("BATCHLINE_MAX_BATCH_MS", "1500")
    assert WorkerSettings().max_batch_ms == 1500
    monkeypatch.setenv("BATCHLINE_MAX_BATCH_MS", "auto")
    assert WorkerSettings().max_batch_ms == "auto"
    for bad in ("-1", "soon", "1.5"):
        with pytest.raises(ValueError, match="max_batch_ms"):
            WorkerSettings(max_batch_ms=bad)


def test_a_fixed_bound_is_the_setting_and_0_is_none() -> None:
    fixed = CallBound(1500)
    fixed.observe(100.0, 1)  # calls timed change nothing
    assert (fixed.auto, fixed.limit_s(), fixed.limit_s(10**6)) == (False, 1.5, 1.5)
    assert fixed.describe(1.5) == "1500"
    assert CallBound(0).limit_s() == 0


def test_the_derived_bound_before_any_call_is_the_cold_one_then_the_floor() -> None:
    bound = CallBound("auto")
    assert bound.limit_s() == COLD_S == 60.0
    bound.observe(0.002, 32)  # a fast model
    assert bound.limit_s() == FLOOR_S == 5.0
    assert bound.describe(5.0) == "auto (5000 ms)"


def test_the_derived_bound_is_ten_times_the_slowest_recent_call_scaled_by_work() -> None:
    bound = CallBound("auto")
    bound.observe(0.8, 320)  # 32 texts of 10 tokens
    bound.observe(1.2, 320)
    bound.observe(0.5, 160)
    assert FACTOR == 10
    assert bound.limit_s() == pytest.approx(12.0)
    assert bound.limit_s(320) == pytest.approx(12.0)  # no more work than the slowest
    # 32 texts of 256 tokens: 25.6 times the work of the slowest call.
    assert bound.limit_s(32 * 256) == pytest.approx(10 * 1.2 * 25.6)
    # The fastest per unit of work counts too where it scales higher: 0.5 s for 160.
    assert bound.limit_s(1600) == pytest.approx(10 * max(1.2 * 5, 0.5 * 10))


def test_recent_calls_leave_after_about_a_thousand_but_the_warm_up_batch_stays() -> None:
    bound = CallBound("auto")
    bound.warmed_up(0.9, 320)
    bound.observe(3.0, 320)  # one slow call (a stall)
    assert bound.limit_s() == pytest.approx(30.0)
    for _ in range(1024):
        bound.observe(0.01, 320)
    assert bound.limit_s() == pytest.approx(9.0)  # the warm-up batch: 10 x 0.9 s
    assert bound.slowest() == (0.9, 320)


def test_a_hung_call_is_judged_at_its_bound_and_slow_at_a_quarter_of_it() -> None:
    bound = CallBound("auto")
    bound.observe(0.001, 1)
    watch = CallWatch(bound, tick_s=TICK_S)
    clock = [1000.0]
    call: Stamp = (clock[0], 1.0)
    states = []
    while not states or states[-1] != "hung":
        clock[0] += TICK_S
        states.append(watch.tick(clock[0], call))
    assert states.index("slow") * TICK_S + TICK_S == pytest.approx(1.5)  # past 1.25 s
    assert len(states) * TICK_S == pytest.approx(5.25)  # past 5 s, the floor
    assert states.count("slow") == 1
    assert (watch.ran_s, watch.limit_s) == (pytest.approx(5.25), 5.0)


def test_a_stopped_process_does_not_hold_the_pause_against_its_call() -> None:
    bound = CallBound("auto")
    bound.observe(0.001, 1)
    watch = CallWatch(bound, tick_s=TICK_S)
    call: Stamp = (0.0, 1.0)
    assert watch.tick(0.25, call) == "running"
    assert watch.tick(60.25, call) == "running"  # SIGSTOP for a minute: two ticks' worth
    assert watch.ran_s == pytest.approx(0.75)
    assert watch.tick(60.5, call) == "running"
    assert watch.ran_s == pytest.approx(1.0)


def test_a_model_whose_batches_get_slowly_longer_never_trips_its_bound() -> None:
    """Inputs grow longer: each batch has 2 % more work than the one before and takes 2.5 %
    longer (attention grows faster than the tokens), from 0.2 s to over 4 minutes; a batch
    now and then is twice as slow as its neighbours (a busy machine)."""
    bound = CallBound("auto")
    bound.warmed_up(0.2, 32 * 16)
    watch = CallWatch(bound, tick_s=TICK_S)
    clock = [0.0]
    seconds, work = 0.2, 32.0 * 16
    states = []
    for i in range(300):
        seconds, work = seconds * 1.025, work * 1.02
        took = seconds * (2 if i % 37 == 0 else 1)
        states.append(run_call(watch, clock, took, work))
        bound.observe(took, work)
    assert seconds > 240
    assert "hung" not in states
    assert "slow" not in states


def test_a_long_batch_of_long_inputs_is_not_taken_for_a_hang() -> None:
    bound = CallBound("auto")
    for _ in range(500):  # short texts: 0.3 s a batch, a bound of 5 s
        bound.observe(0.3, 32 * 12)
    assert bound.limit_s(32 * 12) == FLOOR_S
    watch = CallWatch(bound, tick_s=TICK_S)
    # 32 texts at 512 tokens: 43 times the work; 30 s, far over the short texts' bound.
    assert run_call(watch, [0.0], 30.0, 32 * 512) == "running"
    # The same batch that never returns is judged at 10 x its expected time.
    watch = CallWatch(bound, tick_s=TICK_S)
    assert run_call(watch, [0.0], 10_000.0, 32 * 512) == "hung"
    assert watch.limit_s == pytest.approx(10 * 0.3 * 512 / 12)


class _Model:
    heavy_preprocess = False
    example = "warm-up"

    def __init__(self) -> None:
        self.batches: list[list[object]] = []
        self.sinks: list[object] = []

    def load(self) -> None:
        return None

    def preprocess(self, value: object) -> list[Prepared]:
        return [Prepared(value, 7)]

    def infer(self, batch: list[object]) -> list[object]:
        self.batches.append(batch)
        return batch

    def postprocess(self, outputs: list[object], value: object) -> object:
        return outputs[0]

    def count_padding(self, sink: object) -> None:
        self.sinks.append(sink)


def test_the_warm_up_batch_is_a_full_batch_of_the_example_and_keeps_the_padding_sink() -> None:
    model = _Model()

    def sink(real: int, padded: int) -> None:
        return None

    timing = warm_up(model, batch_size=4, pads=True, padding=sink)
    assert model.batches == [["warm-up"] * 4]
    assert timing is not None
    assert timing[1] == 4 * 7
    assert model.sinks[-1] is sink  # the warm-up's padding went nowhere; the sink is back
    assert work_of([Prepared("a", 3), Prepared("b", 5)], pads=True) == 10
    assert work_of([Prepared("a", 3), Prepared("b", 5)], pads=False) == 8


def test_a_worker_process_starts_from_the_slowest_call_its_predecessor_left(
    tmp_path: Path,
) -> None:
    path = tmp_path / "slowest.json"
    assert read_timing(path) is None
    write_timing(path, (0.4, 64.0))
    bound = CallBound("auto")
    how = prime(bound, None, batch_size=32, pads=True, before=read_timing(path))
    assert how == "slowest call timed 400.0 ms, the previous worker process's"
    assert bound.limit_s() == FLOOR_S  # 10 x 0.4 s is under the floor
    assert bound.limit_s(640) == pytest.approx(40.0)
    path.write_text("not json")
    assert read_timing(path) is None
    assert prime(CallBound("auto"), None, batch_size=1, pads=True) == "no model call timed yet"
