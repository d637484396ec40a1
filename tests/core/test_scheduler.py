"""The generation scheduler, driven directly with a fake clock: no threads, no sleeps."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchline.core.scheduler import GenerationScheduler, SchedulerConfig, footprint, reservation
from batchline.errors import PromptTooLong


@dataclass
class Req:
    """A minimal implementation of the scheduler's ``Sequenced`` protocol."""

    arrival: float
    prompt_tokens: int
    max_new_tokens: int
    priority: int = 0
    deadline: float | None = None
    cancelled: bool = False
    left_at: float = 0.0  # when a running sequence finishes (the fake model)
    overtaken: float = math.inf


def sched(**kw: float) -> GenerationScheduler[Req]:
    return GenerationScheduler(SchedulerConfig(**kw))  # type: ignore[arg-type]


def test_admits_under_both_budgets_in_arrival_order() -> None:
    s = sched(max_batch_size=2, max_batch_tokens=100)
    reqs = [Req(float(i), 10, 10) for i in range(4)]
    for r in reqs:
        s.add(r)
    first = s.admit(10.0, [])
    assert first.admit == reqs[:2]
    assert s.admit(10.0, first.admit).admit == []  # no slot left
    assert s.admit(10.0, [reqs[0]]).admit == [reqs[2]]


def test_token_budget_counts_prompt_plus_max_new_tokens() -> None:
    s = sched(max_batch_size=8, max_batch_tokens=50)
    a, b = Req(0.0, 20, 10), Req(1.0, 15, 10)
    s.add(a)
    s.add(b)
    assert s.admit(2.0, []).admit == [a]  # 2 rows x 30 > 50
    assert s.admit(2.0, [Req(0.0, 5, 5)]).admit == [b]  # 2 rows x 25 = 50


def test_the_budget_counts_rows_times_the_longest_reservation() -> None:
    """The engine's cache is left-padded: a long row widens every row beside it."""
    s = sched(max_batch_size=8, max_batch_tokens=1000)
    running = [Req(0.0, 10, 40) for _ in range(3)]  # 3 x 50: the sum would be 150
    long = Req(1.0, 290, 10)  # 300: the sum would be 450, but 4 rows x 300 = 1200
    s.add(long)
    assert s.admit(1.5, running).admit == []  # it waits: not every row 300 wide
    assert footprint(running) == 150
    assert s.admit(1.5, running[:2]).admit == [long]  # 3 x 300 = 900 fits
    assert footprint([*running[:2], long]) == 900


def test_a_long_prompt_waits_for_room_and_backfill_stops_after_max_backfill_s() -> None:
    s = sched(max_batch_size=8, max_batch_tokens=1000, max_backfill_s=1.0)
    running = [Req(0.0, 10, 40) for _ in range(3)]
    long = Req(1.0, 290, 10)
    s.add(long)
    s.add(small := Req(1.1, 10, 10))
    assert s.admit(1.5, running).admit == [small]  # backfill while it is young
    running.append(small)
    s.add(later := Req(1.6, 10, 10))
    assert s.admit(2.0, running).admit == []  # it has waited 1 s: nobody jumps it
    assert s.admit(2.5, running[:2]).admit == [long]  # 3 x 300 fits once two have left
    assert s.admit(2.5, [*running[:2], long]).admit == []  # a 4th row would make 1200
    assert s.admit(3.0, [long]).admit == [later]


def test_a_prompt_that_can_never_fit_is_refused_at_once() -> None:
    s = sched(max_batch_tokens=64)
    with pytest.raises(PromptTooLong, match="exceeds max_batch_tokens 64"):
        s.add(Req(0.0, 60, 5))
    assert len(s) == 0
    s.add(Req(0.0, 60, 4))  # exactly the budget fits
    assert len(s) == 1


def test_priority_goes_first_until_what_it_overtook_has_waited_the_bound() -> None:
    s = sched(max_batch_size=1, max_overtake_s=0.5)
    old = Req(0.0, 1, 1)
    s.add(old)
    s.add(vip := Req(0.6, 1, 1, priority=1))
    # Nothing overtook the old one yet: however long it waited for a slot, it goes after.
    assert s.admit(1.0, []).admit == [vip]
    assert old.overtaken == 1.0  # its clock starts
    s.add(vip2 := Req(1.2, 1, 1, priority=1))
    assert s.admit(1.4, [vip]).admit == []  # no slot
    assert s.admit(1.4, []).admit == [vip2]  # overtaken 0.4 s ago: still within the bound
    s.add(Req(1.6, 1, 1, priority=1))
    assert s.admit(1.6, []).admit == [old]  # overtaken 0.6 s ago: nothing jumps it now


def test_a_backlog_of_its_own_level_earns_no_precedence_over_a_favoured_request() -> None:
    s = sched(max_batch_size=2, max_overtake_s=0.1)
    backlog = [Req(0.1 * i, 1, 1) for i in range(10)]
    for r in backlog:
        s.add(r)
    assert s.admit(1.0, []).admit == backlog[:2]  # one level: first come, first served
    assert all(r.overtaken == math.inf for r in backlog)
    s.add(vip := Req(1.5, 1, 1, priority=1))
    assert s.admit(2.0, []).admit == [vip, backlog[2]]
    assert backlog[3].overtaken == 2.0  # the one vip displaced
    assert backlog[4].overtaken == math.inf


def test_expired_and_cancelled_leave_without_running() -> None:
    s = sched()
    gone, dead, ok = Req(0.0, 1, 1, cancelled=True), Req(0.0, 1, 1, deadline=1.0), Req(0, 1, 1)
    for r in (gone, dead, ok):
        s.add(r)
    out = s.admit(1.0, [])
    assert (out.admit, out.expired, out.cancelled) == ([ok], [dead], [gone])
    assert len(s) == 0


def test_backfill_stops_once_the_long_prompt_has_waited() -> None:
    s = sched(max_batch_size=8, max_batch_tokens=100, max_backfill_s=1.0)
    running = [Req(0.0, 40, 10)]
    long = Req(0.0, 80, 10)
    s.add(long)
    small = Req(0.1, 5, 5)
    s.add(small)
    assert s.admit(0.5, running).admit == [small]  # backfill while young
    running.append(small)
    s.add(later := Req(0.6, 5, 5))
    assert s.admit(1.5, running).admit == []  # the long one has waited 1 s: nobody jumps it
    assert s.admit(1.6, []).admit == [long]  # beside it a 2nd row would make 2 x 90 > 100
    assert s.admit(1.7, []).admit == [later]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 5),  # arrival
            st.integers(1, 60),  # prompt
            st.integers(1, 40),  # max_new_tokens
            st.integers(0, 2),  # priority
            st.integers(1, 6),  # steps it runs
        ),
        min_size=1,
        max_size=30,
    ),
    st.integers(1, 6),
    st.integers(40, 200),
)
def test_budgets_hold_and_everything_is_admitted_or_refused(
    spec: list[tuple[float, int, int, int, int]], batch_size: int, budget: int
) -> None:
    s = sched(max_batch_size=batch_size, max_batch_tokens=budget, max_backfill_s=0.5)
    pending = sorted(
        (Req(a, p, m, priority=pr, left_at=float(steps)) for a, p, m, pr, steps in spec),
        key=lambda r: r.arrival,
    )
    refused: list[Req] = []
    admitted: list[tuple[float, Req]] = []
    running: list[Req] = []
    now = 0.0
    for _ in range(10_000):
        while pending and pending[0].arrival <= now:
            r = pending.pop(0)
            try:
                s.add(r)
            except PromptTooLong:
                assert reservation(r) > budget
                refused.append(r)
        running = [r for r in running if r.left_at > now]
        out = s.admit(now, running)
        for r in out.admit:
            admitted.append((now, r))
            r.left_at += now
        running += out.admit
        assert len(running) <= batch_size
        assert footprint(running) <= budget
        if not pending and not len(s) and not running:
            break
        now += 0.25
    assert len(admitted) + len(refused) == len(spec), "nothing lost, nothing hangs"
    # Order: within one admission, best rank first.
    for (t1, r1), (t2, r2) in zip(admitted, admitted[1:], strict=False):
        if t1 == t2:
            assert s.rank(r1, t1) <= s.rank(r2, t2)
