"""Which tenants get a label of their own in the per-tenant metrics: the busiest N, the rest
``other``, and a choice that holds (no label flapping from one scrape to the next)."""

from __future__ import annotations

import pytest

from batchline.worker._tenant_labels import OTHER, TenantLabels


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


N = 4
HOLD_S = 900.0


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def labels(clock: Clock) -> TenantLabels:
    return TenantLabels(N, hold_s=HOLD_S, half_life_s=300.0, clock=clock)


def _tenants(n: int) -> list[str]:
    return [f"t{i}" for i in range(n)]


def test_the_busiest_n_of_n_plus_5_get_labels_the_rest_other(
    labels: TenantLabels, clock: Clock
) -> None:
    tenants = _tenants(N + 5)
    labels.update({t: 10 + i for i, t in enumerate(tenants)})  # t8 busiest
    assert labels.chosen == ["t5", "t6", "t7", "t8"]
    shown = {labels.label(t) for t in tenants}
    assert shown == {"t5", "t6", "t7", "t8", OTHER}
    assert labels.label(None) == "-"
    assert labels.label("-") == "-"
    assert labels.label("never-seen") == OTHER


def test_the_choice_holds_while_the_order_of_traffic_changes(
    labels: TenantLabels, clock: Clock
) -> None:
    tenants = _tenants(N + 5)
    labels.update({t: 10 + i for i, t in enumerate(tenants)})
    first = labels.chosen
    # For a while the others are somewhat busier (less than twice): no label changes hands,
    # however many scrapes and updates come.
    for _ in range(100):
        clock.now += 5
        labels.update({t: (15 if t in first else 20) for t in tenants})
        assert labels.chosen == first
    # Nor while a much busier one has not waited for a label held less than hold_s.
    clock.now = 1000.0 + HOLD_S / 2
    assert labels.update({"t0": 10_000}) == []
    assert labels.chosen == first


def test_an_idle_tenant_frees_its_label_for_the_busiest_waiting(
    labels: TenantLabels, clock: Clock
) -> None:
    tenants = _tenants(N + 5)
    labels.update({t: 10 + i for i, t in enumerate(tenants)})
    # t5 goes quiet; the others keep going: t4 (busiest of the rest) takes the freed label.
    freed: list[str] = []
    for _ in range(int(HOLD_S / 60) + 1):
        clock.now += 60
        freed += labels.update({t: 1 + i for i, t in enumerate(tenants) if t != "t5"})
    assert freed == ["t5"]
    assert labels.chosen == ["t4", "t6", "t7", "t8"]
    assert labels.label("t5") == OTHER


def test_requests_waiting_or_in_flight_keep_a_tenant_from_idling(
    labels: TenantLabels, clock: Clock
) -> None:
    labels.update({"slow": 1})
    for _ in range(30):
        clock.now += 60
        assert labels.update({}, busy=["slow"]) == []
    assert labels.chosen == ["slow"]
    clock.now += HOLD_S
    assert labels.update({}) == ["slow"]
    assert labels.chosen == []


def test_a_much_busier_tenant_takes_the_least_busy_label_once_held_long_enough(
    labels: TenantLabels, clock: Clock
) -> None:
    tenants = _tenants(N)
    labels.update(dict.fromkeys(tenants, 10))
    clock.now += HOLD_S
    freed = labels.update({**dict.fromkeys(tenants, 1), "big": 100, "t2": 5})
    assert len(freed) == 1
    assert "big" in labels.chosen
    assert labels.label(freed[0]) == OTHER
    # The label it took is held now: a still busier newcomer takes another, older label
    # (the least busy of those held hold_s), never the one just taken.
    clock.now += 60
    before = labels.chosen
    freed = labels.update({"bigger": 10_000, **dict.fromkeys(before, 1), "big": 0.5})
    assert len(freed) == 1
    assert freed[0] != "big"
    assert labels.chosen == sorted({*before, "bigger"} - set(freed))


def test_no_labels_at_all_with_a_limit_of_zero(clock: Clock) -> None:
    labels = TenantLabels(0, clock=clock)
    labels.update({"a": 5})
    assert labels.label("a") == OTHER
    with pytest.raises(ValueError, match="-1"):
        TenantLabels(-1)
