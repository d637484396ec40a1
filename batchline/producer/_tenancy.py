"""A producer's tenants: the ids it makes for them, and what a request costs.

A tenant's request ids and producer ids start with ``<tenant>.`` (docs/protocol.md,
Tenants), so that Redis ACL key patterns keep tenants apart: a producer makes ids
``<tenant>.<32 hex digits>``, refuses a caller's id outside the tenant's namespace, and reads
one reply stream per tenant, ``<tenant>.<host>-<pid>-<32 hex digits>`` (128 random bits
each: a reply stream's name is all that keeps another holder of the same rights from it).

A tenant's request carries ``cost``, the producer's estimate of its work, which the fair
share and the token quotas count: items for embeddings, rerank and classification, prompt
characters / 4 + ``max_new_tokens`` for a generation; 1 where the value does not tell.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from batchline.codec import MAX_COST
from batchline.keys import MAX_ID_CHARS, check_name, host_id
from batchline.tenants import check_tenant

__all__ = ["estimate_cost", "new_id", "producer_id_for", "request_id_for"]

#: A generation's max_new_tokens where the request names none (the worker's default).
DEFAULT_NEW_TOKENS = 128


def new_id() -> str:
    """128 random bits in hex (os.urandom is 4x quicker than uuid4 here)."""
    return os.urandom(16).hex()


def producer_id_for(tenant: str | None) -> str:
    """A new producer id (a reply stream's name): ``<host>-<pid>-<32 hex>``, for a tenant
    ``<tenant>.`` before it (the host cut where the whole would pass 128 characters)."""
    tail = f"-{os.getpid()}-{new_id()}"
    head = host_id() if tenant is None else f"{check_tenant(tenant)}.{host_id()}"
    return check_name("producer id", head[: MAX_ID_CHARS - len(tail)] + tail)


def request_id_for(tenant: str | None, request_id: str | None) -> str:
    """The id of a new request: the caller's (checked: in the tenant's namespace, where there
    is a tenant; ValueError naming it otherwise), or a random one."""
    if request_id is None:
        return new_id() if tenant is None else f"{tenant}.{new_id()}"
    check_name("request_id", request_id)
    if tenant is not None and not request_id.startswith(f"{tenant}."):
        raise ValueError(
            f"request_id {request_id!r} is not in tenant {tenant!r}'s namespace: a tenant's "
            f"request ids start with {tenant + '.'!r}"
        )
    return request_id


def _chars(value: Any) -> int:
    """The characters of a prompt, or of a chat's messages' contents."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    if isinstance(value, Mapping):
        content = value.get("content")
        return _chars(content) if content is not None else 0
    return 0


def estimate_cost(value: Any, *, generation: bool = False) -> int:
    """What a request costs, estimated from its value: a generation (an object with
    ``prompt`` or ``messages``, or any value streamed: ``generation``) prompt characters / 4
    + ``max_new_tokens``; a rerank (``query`` and ``documents``) its documents; a list of
    texts (or pairs) its items; anything else 1. Clamped to 1..MAX_COST."""
    cost = 1
    if isinstance(value, Mapping) and ("prompt" in value or "messages" in value):
        prompt = value.get("prompt", value.get("messages"))
        new = value.get("max_new_tokens", DEFAULT_NEW_TOKENS)
        new = new if isinstance(new, int) and not isinstance(new, bool) else DEFAULT_NEW_TOKENS
        cost = _chars(prompt) // 4 + new
    elif generation and isinstance(value, str):
        cost = len(value) // 4 + DEFAULT_NEW_TOKENS
    elif isinstance(value, Mapping) and isinstance(value.get("documents"), list):
        cost = len(value["documents"])
    elif isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
        cost = len(value)
    return min(max(cost, 1), MAX_COST)
