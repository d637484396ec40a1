"""Tenants: who a request is for, and what each may use (pure: no I/O).

A tenant is a name of 1-64 characters of letters, digits, ``_`` and ``-`` (not starting with
``file-`` or ``batch_``, the Batch API's objects' prefixes; no dot: a tenant's
request ids and producer ids start with ``<tenant>.``, so that Redis ACL key patterns such as
``res:<tenant>.*`` hold one tenant's keys and no other's). A tenant's :class:`TenantConfig`
(weight in the fair share, quotas, the highest priority it may ask for) travels as JSON in the
global tenant store and in each queue's ``tenants`` hash (docs/protocol.md, Tenants).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = [
    "MAX_TENANT_CHARS",
    "OVER_QUOTA",
    "RESERVED_PREFIXES",
    "TENANT_PATTERN",
    "UNTENANTED",
    "TenantConfig",
    "check_tenant",
    "is_tenant",
    "over_quota_name",
    "split_held",
    "tenant_id",
    "tenant_of",
]

#: The longest tenant name.
MAX_TENANT_CHARS = 64
#: Every tenant name, for pydantic and OpenAPI patterns (in Python: :func:`is_tenant`).
TENANT_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
#: How untenanted traffic is named where a name is needed (usage counters, metrics): no
#: tenant may be called this (``-`` alone is not a valid tenant name).
UNTENANTED = "-"

#: The suffix of the pseudo-tenant ``<tenant>~over`` under which the fair share holds a
#: tenant's requests over its quota (``over_quota: idle``): served only when nothing else
#: waits, at any priority.
OVER_QUOTA = "~over"

_TENANT = re.compile(r"[A-Za-z0-9_-]{1,64}")

OverQuota = Literal["refuse", "idle"]


#: Tenant names may not start with these: the Batch API's untenanted line ids are
#: ``file-<hex>.<digest>``, which a tenant called ``file-<hex>`` would read as its own.
RESERVED_PREFIXES = ("file-", "batch_")


def is_tenant(value: object) -> bool:
    """Whether ``value`` is a valid tenant name."""
    return (
        isinstance(value, str)
        and value != UNTENANTED
        and _TENANT.fullmatch(value) is not None
        and not value.startswith(RESERVED_PREFIXES)
    )


def check_tenant(value: object) -> str:
    """Validate a tenant name; return it (ValueError naming the value otherwise)."""
    if not isinstance(value, str) or not is_tenant(value):
        raise ValueError(
            "a tenant must be 1-64 characters of letters, digits, '_' or '-' (not '-' alone, "
            f"not starting with {' or '.join(RESERVED_PREFIXES)}), got {value!r}"
        )
    return value


def tenant_id(tenant: str, name: str) -> str:
    """``name`` in ``tenant``'s namespace: ``<tenant>.<name>`` (a request or producer id)."""
    return f"{check_tenant(tenant)}.{name}"


def tenant_of(name: str) -> str | None:
    """The tenant whose namespace a request or producer id is in, or None (untenanted)."""
    head, dot, _ = name.partition(".")
    return head if dot and is_tenant(head) else None


def over_quota_name(tenant: str) -> str:
    """The pseudo-tenant holding ``tenant``'s requests over its quota (``<tenant>~over``)."""
    return tenant + OVER_QUOTA


def split_held(name: str) -> tuple[str, bool]:
    """Who a backlog's holder is (a member of ``fair:<p>``): the tenant, and whether it is
    that tenant's requests over quota (``<tenant>~over``)."""
    if name.endswith(OVER_QUOTA):
        return name[: -len(OVER_QUOTA)], True
    return name, False


def _limit(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 (0: no limit), got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """What a tenant may use. 0 means no limit.

    Attributes:
        weight: its share of the workers within a priority, against the other backlogged
            tenants' weights (> 0; default 1).
        requests_per_min: requests admitted per minute (per queue).
        tokens_per_min: tokens per minute (per queue): estimated at admission, corrected
            when known.
        max_in_flight: requests admitted and not answered yet (per queue).
        max_priority: the highest priority its requests get (a higher one is lowered to it;
            None: any).
        over_quota: ``"refuse"`` (a ``QuotaExceeded`` error) or ``"idle"`` (run it when the
            workers would otherwise idle, below every other request).
    """

    weight: float = 1.0
    requests_per_min: int = 0
    tokens_per_min: int = 0
    max_in_flight: int = 0
    max_priority: int | None = None
    over_quota: OverQuota = "refuse"

    def __post_init__(self) -> None:
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"weight must be a finite number > 0, got {w!r}")
        if not 0 < w <= 1_000_000:
            raise ValueError(f"weight must be in (0, 1000000], got {w!r}")
        _limit("requests_per_min", self.requests_per_min)
        _limit("tokens_per_min", self.tokens_per_min)
        _limit("max_in_flight", self.max_in_flight)
        if self.max_priority is not None:
            _limit("max_priority", self.max_priority)
        if self.over_quota not in ("refuse", "idle"):
            raise ValueError(f"over_quota must be 'refuse' or 'idle', got {self.over_quota!r}")

    def to_json(self) -> str:
        """The config as the tenant store and the queues' ``tenants`` hash hold it."""
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, data: str | bytes) -> TenantConfig:
        """Read :meth:`to_json`'s output (unknown fields ignored, for rolling upgrades);
        ValueError on anything else."""
        try:
            raw: Any = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"a tenant's config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"a tenant's config must be a JSON object, got {type(raw).__name__}")
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**known)
