"""What a route does in its caller's name (:mod:`._caller`): the producer calls that name the
caller's tenant, and the ids it makes in the tenant's namespace.

The app serves every tenant with one producer per queue: each call names the tenant
(``tenant=``), so that the queue's admission counts the request against that tenant's quotas
and fair share, and caches its answer for that tenant alone (docs/protocol.md, Tenants). An
untenanted caller (the open API) names none: its requests go as today's.
"""

from __future__ import annotations

from typing import Any

from batchline.tenants import tenant_id

__all__ = ["as_tenant", "scoped_id"]


def as_tenant(tenant: str | None) -> dict[str, Any]:
    """The keyword arguments of a producer call (``submit``, ``stream``, ``cancel``) made for
    ``tenant``: ``{"tenant": tenant}``, or none for an untenanted caller."""
    return {} if tenant is None else {"tenant": tenant}


def scoped_id(tenant: str | None, name: str) -> str:
    """A request id the app chooses, in ``tenant``'s namespace (``<tenant>.<name>``: the
    admission takes no other from a tenant), or ``name`` as it is for an untenanted caller."""
    return name if tenant is None else tenant_id(tenant, name)
