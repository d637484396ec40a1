"""Tenant names and configs (batchline.tenants): what is a tenant, what its config reads."""

from __future__ import annotations

import pickle

import pytest

from batchline.errors import BatchlineError, QuotaExceeded
from batchline.tenants import TenantConfig, check_tenant, is_tenant, tenant_id, tenant_of


@pytest.mark.parametrize("name", ["acme", "a", "A_b-9", "x" * 64])
def test_valid_tenant_names(name: str) -> None:
    assert is_tenant(name)
    assert check_tenant(name) == name


@pytest.mark.parametrize(
    "name", ["", "-", "a.b", "a b", "x" * 65, "é", None, 3, "a\n", "file-0a1b", "batch_x"]
)
def test_invalid_tenant_names_are_refused_naming_the_value(name: object) -> None:
    assert not is_tenant(name)
    with pytest.raises(ValueError, match="tenant must be"):
        check_tenant(name)


def test_ids_in_a_tenants_namespace() -> None:
    assert tenant_id("acme", "r1") == "acme.r1"
    assert tenant_of("acme.r1") == "acme"
    assert tenant_of("acme.x.y") == "acme"
    assert tenant_of("r1") is None
    assert tenant_of(".r1") is None
    # An untenanted Batch API line's id is no tenant's.
    assert tenant_of("file-0123456789abcdef01234567." + "0" * 40) is None
    with pytest.raises(ValueError, match="tenant must be"):
        tenant_id("a.b", "r1")


def test_config_round_trips_and_ignores_unknown_fields() -> None:
    config = TenantConfig(weight=3, requests_per_min=60, max_priority=1, over_quota="idle")
    assert TenantConfig.from_json(config.to_json()) == config
    assert TenantConfig.from_json('{"weight": 2, "later": 1}') == TenantConfig(weight=2)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("weight", 0),
        ("weight", -1),
        ("weight", float("nan")),
        ("weight", True),
        ("requests_per_min", -1),
        ("tokens_per_min", 1.5),
        ("max_in_flight", "3"),
        ("max_priority", -1),
        ("over_quota", "queue"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        TenantConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("data", ["[1]", "not json", '{"weight": "x"}'])
def test_bad_config_json_is_a_value_error(data: str) -> None:
    with pytest.raises(ValueError, match="config|weight"):
        TenantConfig.from_json(data)


def test_quota_exceeded_carries_its_retry_time_and_pickles_whole() -> None:
    error = QuotaExceeded(
        "tenant acme: requests_per_min=60 reached",
        tenant="acme",
        limit="requests_per_min",
        retry_after_s=12.5,
    )
    assert isinstance(error, BatchlineError)
    again = pickle.loads(pickle.dumps(error))
    assert (again.tenant, again.limit, again.retry_after_s) == ("acme", "requests_per_min", 12.5)
    assert str(again) == str(error)
