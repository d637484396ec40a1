"""Who is calling the HTTP API: the tenant an API key names, whether it is an admin, and its
config. The key check (``_auth``) puts one on ``request.state.caller``; every route reads it
with :func:`caller_of`, which gives the open API's caller where no check ran."""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.requests import HTTPConnection

from batchline.tenants import TenantConfig

__all__ = ["OPEN", "Caller", "caller_of"]


@dataclass(frozen=True, slots=True)
class Caller:
    """The caller of one HTTP request.

    Attributes:
        tenant: the tenant its key names; None on an open API (no keys): untenanted.
        admin: sees and manages every tenant's files, batches and jobs.
        config: the tenant's weight and quotas.
        key_id: the public id of the key used (never the key), for logs; None without one.
    """

    tenant: str | None
    admin: bool = False
    config: TenantConfig = field(default_factory=TenantConfig)
    key_id: str | None = None

    def may_see(self, owner: str | None) -> bool:
        """Whether this caller may see an object (a file, a batch, a job) owned by
        ``owner`` (None: untenanted)."""
        return self.admin or owner == self.tenant


#: The caller of an open API (no keys configured): untenanted, sees everything untenanted.
OPEN = Caller(tenant=None, admin=True)


def caller_of(connection: HTTPConnection) -> Caller:
    """The caller the key check found for this request, or :data:`OPEN` where none ran."""
    found = getattr(connection.state, "caller", None)
    return found if isinstance(found, Caller) else OPEN
