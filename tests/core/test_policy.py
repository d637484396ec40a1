"""The batch policy, driven directly with a fake clock: no threads, no sleeps."""

from __future__ import annotations

import itertools
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchline.core.policy import BatchPolicy, PolicyConfig
from batchline.errors import ItemTooLarge

_ids = itertools.count()


class FakeItem:
    """A minimal implementation of the policy's ``Waiting`` protocol."""

    __slots__ = (
        "_cancelled",
        "arrival",
        "deadline",
        "id",
        "length",
        "overtaken",
        "priority",
        "queued",
        "small",
    )

    def __init__(
        self,
        arrival: float,
        *,
        deadline: float | None = None,
        length: int = 1,
        priority: int = 0,
        small: bool = False,
    ) -> None:
        self.id = next(_ids)
        self.arrival = arrival
        self.deadline = deadline
        self.length = length
        self.priority = priority
        self.small = small
        self.queued = False
        self.overtaken = math.inf
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        self._cancelled = True

    def __repr__(self) -> str:
        return f"<item {self.id} t={self.arrival} len={self.length}>"


def make(**config: object) -> BatchPolicy[FakeItem]:
    return BatchPolicy(PolicyConfig(**config))  # type: ignore[arg-type]


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("batch_size", 0, "batch_size must be an int >= 1, got 0"),
        ("batch_size", 1.5, "batch_size must be an int >= 1, got 1.5"),
        ("timeout_s", -0.001, "timeout must be >= 0"),
        ("timeout_s", float("nan"), "timeout must be >= 0, got nan"),
        ("max_tokens", 0, "max_tokens must be an int >= 1 or None, got 0"),
        ("max_overtake_s", -1.0, "max_overtake_s must be >= 0"),
        ("group_window", 0, "group_window must be an int >= 1, got 0"),
    ],
)
def test_config_rejects_bad_values_naming_them(option: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        PolicyConfig(**{option: value})  # type: ignore[arg-type]


# -- size and timeout ------------------------------------------------------------------------


def test_batch_never_exceeds_batch_size() -> None:
    policy = make(batch_size=4, timeout_s=1.0)
    items = [FakeItem(0.0) for _ in range(10)]
    for it in items:
        policy.add(it)
    sizes = []
    out = []
    while len(policy):
        decision = policy.poll(0.0)
        assert decision.batch, "a full queue dispatches at once"
        sizes.append(len(decision.batch))
        out.extend(decision.batch)
        if len(policy) < 4:
            decision = policy.poll(1.0)
            sizes.append(len(decision.batch))
            out.extend(decision.batch)
    assert sizes == [4, 4, 2]
    assert out == items, "one lane is FIFO"
    assert not any(it.queued for it in items)


def test_timeout_runs_from_the_oldest_item() -> None:
    # Binary-exact times, so that "at due" is exactly equal, not off by a rounding.
    policy = make(batch_size=8, timeout_s=0.25)
    first, second = FakeItem(100.0), FakeItem(100.125)
    policy.add(first)
    policy.add(second)
    early = policy.poll(100.2)
    assert early.batch == []
    assert early.expired == []
    assert early.wake_at == 100.25, "due from the oldest item, not the newest"
    due = policy.poll(100.25)
    assert due.batch == [first, second]
    assert due.wake_at is None
    assert len(policy) == 0


def test_empty_policy_asks_to_sleep_until_an_add() -> None:
    decision = make().poll(5.0)
    assert (decision.batch, decision.expired, decision.wake_at) == ([], [], None)


def test_zero_timeout_dispatches_at_once() -> None:
    policy = make(batch_size=8, timeout_s=0.0)
    item = FakeItem(3.0)
    policy.add(item)
    assert policy.poll(3.0).batch == [item]


def test_flush_dispatches_before_the_timeout() -> None:
    policy = make(batch_size=8, timeout_s=100.0)
    item = FakeItem(0.0)
    policy.add(item)
    assert policy.poll(0.0).batch == []
    assert policy.poll(0.0, flush=True).batch == [item]


def test_wake_at_is_the_earliest_deadline_when_it_comes_first() -> None:
    policy = make(batch_size=8, timeout_s=10.0)
    policy.add(FakeItem(0.0))
    policy.add(FakeItem(0.0, deadline=2.5))
    assert policy.poll(1.0).wake_at == pytest.approx(2.5)


# -- add: when must a sleeping driver wake ---------------------------------------------------


def test_add_wakes_for_the_first_item_only_until_the_batch_is_full() -> None:
    policy = make(batch_size=3, timeout_s=1.0)
    assert policy.add(FakeItem(0.0)) is True  # a new timeout starts
    assert policy.add(FakeItem(0.0)) is False
    assert policy.add(FakeItem(0.0)) is True  # a full batch


def test_add_wakes_again_after_the_queue_emptied() -> None:
    policy = make(batch_size=8, timeout_s=0.0)
    policy.add(FakeItem(0.0))
    assert policy.poll(0.0).batch
    assert policy.add(FakeItem(1.0)) is True


def test_add_wakes_when_a_deadline_comes_earlier() -> None:
    policy = make(batch_size=8, timeout_s=1.0)
    assert policy.add(FakeItem(0.0, deadline=5.0)) is True  # first item
    assert policy.add(FakeItem(0.0, deadline=6.0)) is False
    assert policy.add(FakeItem(0.0)) is False
    assert policy.add(FakeItem(0.0, deadline=4.0)) is True


def test_add_wakes_when_the_token_budget_is_exceeded() -> None:
    policy = make(batch_size=8, timeout_s=1.0, max_tokens=10)
    assert policy.add(FakeItem(0.0, length=3)) is True  # first item
    assert policy.add(FakeItem(0.0, length=3)) is False  # 2 x 3 = 6
    assert policy.add(FakeItem(0.0, length=3)) is False  # 3 x 3 = 9
    assert policy.add(FakeItem(0.0, length=3)) is True  # 4 x 3 = 12 > 10


def test_add_wakes_when_one_long_item_breaks_the_budget() -> None:
    policy = make(batch_size=8, timeout_s=1.0, max_tokens=10)
    policy.add(FakeItem(0.0, length=2))
    assert policy.add(FakeItem(0.0, length=6)) is True  # 2 x 6 = 12 > 10


# -- order: small calls, priorities, no starvation -------------------------------------------


def test_small_items_go_first_within_the_overtake_bound() -> None:
    policy = make(batch_size=2, timeout_s=1.0, max_overtake_s=0.1)
    large = [FakeItem(0.0) for _ in range(2)]
    small = FakeItem(0.05, small=True)
    for it in [*large, small]:
        policy.add(it)
    first = policy.poll(0.05).batch
    assert first == [small, large[0]]


def test_an_item_overtaken_longer_than_the_bound_is_not_overtaken_again() -> None:
    policy = make(batch_size=1, timeout_s=0.0, max_overtake_s=0.1)
    large = FakeItem(0.0)
    first_small = FakeItem(0.01, small=True)
    policy.add(large)
    policy.add(first_small)
    assert policy.poll(0.01).batch == [first_small]  # the large item's clock starts
    newer_small = [FakeItem(0.2 + i * 0.01, small=True) for i in range(4)]
    for it in newer_small:
        policy.add(it)
    batches = [policy.poll(0.2).batch for _ in range(5)]
    assert batches[0] == [large], "overtaken 190 ms ago: nothing new overtakes it"
    assert [it for b in batches for it in b] == [large, *newer_small]


def test_a_backlog_of_its_own_level_earns_no_precedence_over_a_favoured_item() -> None:
    # Items that waited only behind others of their level (a backlog read ahead of the
    # function) were never overtaken: a favoured item arriving much later goes first.
    policy = make(batch_size=4, timeout_s=0.0, max_overtake_s=0.1)
    backlog = [FakeItem(0.0) for _ in range(40)]
    for it in backlog:
        policy.add(it)
    assert policy.poll(0.0).batch == backlog[:4]
    urgent = FakeItem(5.0, priority=1)
    policy.add(urgent)
    assert policy.poll(5.0).batch == [urgent, *backlog[4:7]]
    # backlog[7] was left out for the urgent item: its clock runs from 5.0.
    assert backlog[7].overtaken == 5.0
    assert all(it.overtaken == math.inf for it in backlog[8:])
    late = FakeItem(5.2, priority=1)
    policy.add(late)
    assert policy.poll(5.2).batch == [backlog[7], late, *backlog[8:10]]


def test_a_stream_of_small_items_never_starves_a_large_one() -> None:
    policy = make(batch_size=1, timeout_s=0.0, max_overtake_s=0.1)
    large = FakeItem(0.0)
    policy.add(large)
    now = 0.0
    for step in range(100):
        now = (step + 1) * 0.01
        policy.add(FakeItem(now, small=True))
        if large in policy.poll(now).batch:
            break
    else:
        pytest.fail("the large item never left the queue")
    # First overtaken at 0.01: it leaves within one step of max_overtake_s after that.
    assert now <= 0.01 + 0.1 + 0.01 + 1e-9


def test_priority_lane_goes_first_but_is_bounded() -> None:
    policy = make(batch_size=1, timeout_s=0.0, max_overtake_s=0.1)
    old = FakeItem(0.0)
    recent_urgent = FakeItem(0.05, priority=1)
    policy.add(old)
    policy.add(recent_urgent)
    assert policy.poll(0.05).batch == [recent_urgent]  # old is overtaken from 0.05 on
    late_urgent = FakeItem(0.3, priority=1)
    policy.add(late_urgent)
    order = [policy.poll(0.3).batch[0] for _ in range(2)]
    assert order == [old, late_urgent]


def test_two_priority_levels_overtake_twice_as_long() -> None:
    policy = make(batch_size=1, timeout_s=0.0, max_overtake_s=0.1)
    old = FakeItem(0.0)
    urgent = FakeItem(0.15, priority=2)
    policy.add(old)
    policy.add(urgent)
    assert policy.poll(1.0).batch == [urgent]


# -- deadlines and cancellation --------------------------------------------------------------


def test_expired_items_come_back_in_expired_and_never_in_a_batch() -> None:
    policy = make(batch_size=8, timeout_s=1.0)
    keep = FakeItem(0.0)
    doomed = FakeItem(0.0, deadline=0.5)
    policy.add(keep)
    policy.add(doomed)
    decision = policy.poll(0.5)
    assert decision.expired == [doomed]
    assert decision.batch == []
    assert not doomed.queued
    assert len(policy) == 1
    later = policy.poll(1.0)
    assert later.batch == [keep]
    assert later.expired == []


def test_an_item_past_its_deadline_is_expired_even_when_a_batch_is_due() -> None:
    policy = make(batch_size=2, timeout_s=0.0)
    ok, late = FakeItem(0.0), FakeItem(0.0, deadline=1.0)
    policy.add(ok)
    policy.add(late)
    decision = policy.poll(2.0)
    assert decision.expired == [late]
    assert decision.batch == [ok]


def test_cancelled_items_are_skipped_and_not_counted() -> None:
    policy = make(batch_size=3, timeout_s=1.0)
    items = [FakeItem(0.0) for _ in range(5)]
    for it in items:
        policy.add(it)
    items[0].cancel()
    items[2].cancel()
    batch = policy.poll(1.0).batch
    assert batch == [items[1], items[3], items[4]], "cancelled items take no place in a batch"
    assert len(policy) == 0
    assert policy.poll(2.0).batch == []


def test_a_cancelled_head_does_not_start_the_timeout() -> None:
    policy = make(batch_size=8, timeout_s=1.0)
    gone = FakeItem(0.0)
    policy.add(gone)
    live = FakeItem(0.5)
    policy.add(live)
    gone.cancel()
    decision = policy.poll(1.0)
    assert decision.batch == []
    assert decision.wake_at == pytest.approx(1.5)
    assert policy.poll(1.5).batch == [live]


def test_a_cancelled_item_with_a_deadline_is_not_reported_expired() -> None:
    policy = make(batch_size=8, timeout_s=1.0)
    gone = FakeItem(0.0, deadline=0.5)
    policy.add(gone)
    gone.cancel()
    decision = policy.poll(0.6)
    assert decision.expired == []
    assert decision.batch == []
    assert len(policy) == 0


# -- token budget ----------------------------------------------------------------------------


def test_check_length_refuses_an_item_longer_than_the_budget() -> None:
    policy = make(max_tokens=16)
    policy.check_length(16)
    with pytest.raises(ItemTooLarge, match="16"):
        policy.check_length(17)
    make().check_length(10**9)  # no budget, no limit


def test_max_tokens_is_never_exceeded_by_rows_times_longest_row() -> None:
    policy = make(batch_size=8, timeout_s=0.0, max_tokens=12)
    lengths = [2, 2, 2, 5, 1, 1, 6, 6, 3]
    items = [FakeItem(0.0, length=n) for n in lengths]
    for it in items:
        policy.add(it)
    out = []
    while len(policy):
        batch = policy.poll(0.0).batch
        assert batch
        assert len(batch) * max(it.length for it in batch) <= 12
        out.extend(batch)
    assert sorted(it.id for it in out) == sorted(it.id for it in items)


def test_token_budget_without_grouping_keeps_arrival_order() -> None:
    policy = make(batch_size=8, timeout_s=0.0, max_tokens=6)
    items = [FakeItem(0.0, length=n) for n in (1, 1, 3, 1)]
    for it in items:
        policy.add(it)
    first = policy.poll(0.0).batch
    assert first == items[:2], "1,1 fit; adding 3 would make 3 x 3 = 9 > 6"
    second = policy.poll(0.0).batch
    assert second == items[2:]


# -- length grouping -------------------------------------------------------------------------


def test_length_grouping_anchors_on_the_oldest_and_takes_the_closest_lengths() -> None:
    policy = make(batch_size=3, timeout_s=1.0, group_by_length=True, group_window=4)
    lengths = [10, 2, 50, 11, 3, 9, 48, 12]
    items = [FakeItem(i * 0.001, length=n) for i, n in enumerate(lengths)]
    for it in items:
        policy.add(it)
    batch = policy.poll(0.0).batch
    assert batch[0] is items[0], "the anchor is the oldest item"
    assert sorted(it.length for it in batch) == [9, 10, 11]
    assert [it.arrival for it in batch] == sorted(it.arrival for it in batch)
    # The next batch anchors on the oldest of what is left: length 2.
    second = policy.poll(0.0).batch
    assert second[0] is items[1]
    assert sorted(it.length for it in second) == [2, 3, 12]


def test_length_grouping_is_off_when_everything_fits_one_batch() -> None:
    policy = make(batch_size=8, timeout_s=0.0, group_by_length=True)
    items = [FakeItem(0.0, length=n) for n in (5, 1, 9)]
    for it in items:
        policy.add(it)
    assert policy.poll(0.0).batch == items


def test_length_grouping_with_budget_skips_what_does_not_fit() -> None:
    policy = make(batch_size=4, timeout_s=0.0, max_tokens=20, group_by_length=True)
    items = [FakeItem(0.0, length=n) for n in (5, 20, 4, 6, 5)]
    for it in items:
        policy.add(it)
    batch = policy.poll(0.0).batch
    assert batch[0] is items[0]
    assert len(batch) * max(it.length for it in batch) <= 20
    assert items[1] not in batch
    assert len(batch) == 3  # 5, 5, 4 (x 5 = 15); a fourth would need 4 x 6 = 24


# -- drain -----------------------------------------------------------------------------------


def test_drain_returns_the_live_items_and_empties_the_queue() -> None:
    policy = make(batch_size=8, timeout_s=1.0)
    items = [FakeItem(0.0, priority=i % 2, small=i % 3 == 0) for i in range(6)]
    for it in items:
        policy.add(it)
    items[4].cancel()
    drained = policy.drain()
    assert sorted(it.id for it in drained) == sorted(it.id for it in items if it is not items[4])
    assert not any(it.queued for it in items)
    assert len(policy) == 0
    assert policy.poll(5.0).batch == []
    assert policy.add(FakeItem(6.0)) is True, "an emptied queue wakes on the next add"


# -- property: nothing lost, nothing duplicated, limits hold ---------------------------------

actions = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 12),  # length
            st.integers(0, 2),  # priority
            st.booleans(),  # small
            st.one_of(st.none(), st.floats(0.0, 0.05)),  # deadline offset
        ),
        st.tuples(st.just("poll"), st.floats(0.0, 0.02), st.booleans()),
        st.tuples(st.just("cancel"), st.integers(0, 1000)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(
    actions=actions,
    batch_size=st.integers(1, 6),
    timeout_s=st.sampled_from([0.0, 0.005, 0.02]),
    max_tokens=st.one_of(st.none(), st.integers(12, 40)),
    group=st.booleans(),
)
def test_every_item_leaves_exactly_once_within_the_limits(
    actions: list[tuple[object, ...]],
    batch_size: int,
    timeout_s: float,
    max_tokens: int | None,
    group: bool,
) -> None:
    policy = make(
        batch_size=batch_size,
        timeout_s=timeout_s,
        max_tokens=max_tokens,
        group_by_length=group,
        group_window=2,
        max_overtake_s=0.01,
    )
    now = 0.0
    added: list[FakeItem] = []
    left: dict[int, str] = {}

    def take(decision_now: float, flush: bool = False) -> None:
        decision = policy.poll(decision_now, flush=flush)
        assert len(decision.batch) <= batch_size
        if decision.batch and max_tokens is not None:
            assert len(decision.batch) * max(it.length for it in decision.batch) <= max_tokens
        for kind, group_ in (("batch", decision.batch), ("expired", decision.expired)):
            for it in group_:
                assert it.id not in left, f"{it} left twice"
                assert not it.cancelled, f"cancelled {it} came out in {kind}"
                assert not it.queued
                if kind == "expired":
                    assert it.deadline is not None
                    assert it.deadline <= decision_now
                left[it.id] = kind
        if not decision.batch and not flush and len(policy):
            assert decision.wake_at is not None
            assert decision.wake_at > decision_now

    for action in actions:
        if action[0] == "add":
            _, length, priority, small, offset = action
            item = FakeItem(
                now,
                length=int(length),  # type: ignore[call-overload]
                priority=int(priority),  # type: ignore[call-overload]
                small=bool(small),
                deadline=None if offset is None else now + float(offset),  # type: ignore[arg-type]
            )
            policy.check_length(item.length)  # lengths <= 12 <= max_tokens always fit
            policy.add(item)
            added.append(item)
        elif action[0] == "poll":
            _, step, flush = action
            now += float(step)  # type: ignore[arg-type]
            take(now, bool(flush))
        elif added:
            added[int(action[1]) % len(added)].cancel()  # type: ignore[call-overload]

    # Let time run on: everything still queued must leave, in batches or expired.
    for _ in range(len(added) + 2):
        now += timeout_s + 0.001
        take(now)
    assert len(policy) == 0
    for it in added:
        assert it.cancelled or it.id in left, f"{it} was lost"
        assert not it.queued
