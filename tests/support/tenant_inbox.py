"""Requests appended to a queue's inboxes by hand, as the tenant functions write them (a
tenant's inbox and a wake each) or as an untenanted producer does (the shared inbox): for
tests of the admission and the fair share that decide the queue's state without a producer."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import redis

from batchline.codec._requests import request_fields
from batchline.keys import QueueKeys


def enqueue(
    client: redis.Redis,
    keys: QueueKeys,
    tenant: str | None,
    name: str,
    value: Any,
    *,
    cost: int = 1,
    priority: int = 0,
    reply: str | None = None,
) -> str:
    """Append one request to ``tenant``'s inbox (and its wake), or to the shared inbox
    (``reply``: the producer it names for its answer)."""
    request_id = f"{tenant}.{name}" if tenant else name
    fields, _meta, _blob = request_fields(
        request_id,
        value,
        priority=priority,
        deadline_unix_ms=None,
        enqueued_unix_ms=time.time() * 1e3,
        reply=reply,
        stream=False,
    )
    element = msgpack.packb(["r", priority, *fields, "cost", str(cost)], use_bin_type=False)
    if tenant is None:
        client.rpush(keys.inbox, element)
    else:
        client.rpush(keys.tenant_inbox(tenant), element)
        client.rpush(keys.wakes, msgpack.packb(["t", tenant], use_bin_type=False))
    return request_id


def enqueue_each(
    client: redis.Redis, keys: QueueKeys, tenant: str, n: int, **options: Any
) -> list[str]:
    """``n`` requests of ``tenant`` (ids ``<tenant>.<t><i>``, values ``<T><i>``)."""
    low = tenant.lower()
    return [enqueue(client, keys, tenant, f"{low}{i}", f"{tenant}{i}", **options) for i in range(n)]


def cancel(client: redis.Redis, keys: QueueKeys, tenant: str, request_id: str) -> None:
    """Append a cancel of ``request_id`` to ``tenant``'s inbox (and its wake)."""
    client.rpush(keys.tenant_inbox(tenant), msgpack.packb(["c", request_id], use_bin_type=False))
    client.rpush(keys.wakes, msgpack.packb(["t", tenant], use_bin_type=False))
