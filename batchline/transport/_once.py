"""The hashes that make an answer computed once: a request's input hash (the same id must
mean the same input) and an input's cache hash (one input of one model).

The enqueue script computes both in Lua (``redis.sha1hex``) from the fields it adds, so a
producer cannot claim one input and send another; a worker computes them again here from
what it read before it lets its answer fill the cache (docs/protocol.md, Answers computed
once). Both sides must agree byte for byte: the input hash is SHA-1 of the decimal length
of ``meta``, a colon, ``meta`` and ``blob``; the cache hash SHA-1 of the model identity, a
newline and the input hash (hex, lower case).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from batchline.keys import QueueKeys

if TYPE_CHECKING:
    from batchline.transport._client import RedisClient

__all__ = [
    "ONCE_COUNTERS",
    "cache_hash",
    "cached_result",
    "input_hash",
    "once_figures",
    "once_keys",
]


def once_keys(keys: QueueKeys) -> list[str]:
    """What the enqueue script and the queue's functions take after the TTLs (arguments 5
    to 11): the key prefixes of results, request inputs, waiters, the cache and in-flight
    marks, the model key and the counters' key."""
    return [
        keys.result(""),
        keys.request_input(""),
        keys.waiters(""),
        keys.cache(""),
        keys.in_flight(""),
        keys.model,
        keys.once_stats,
    ]


def input_hash(meta: bytes, blob: bytes) -> str:
    """The input hash of a request's encoded value (``meta`` and ``blob`` as they travel)."""
    digest = hashlib.sha1(b"%d:" % len(meta), usedforsecurity=False)
    digest.update(meta)
    digest.update(blob)
    return digest.hexdigest()


def cache_hash(model_id: str, input_key: str, tenant: str | None = None) -> str:
    """The cache hash of one input (its :func:`input_hash`) for the model ``model_id``, and
    for ``tenant`` (None: untenanted): tenants never share cached answers."""
    data = model_id.encode() + b"\n" + input_key.encode()
    if tenant is not None:
        data += b"\n" + tenant.encode()
    return hashlib.sha1(data, usedforsecurity=False).hexdigest()


#: The enqueue script's counters (the queue's ``once`` hash).
ONCE_COUNTERS = ("existing", "attached", "conflict", "hit", "miss", "coalesced")


def once_figures(raw: dict[Any, Any]) -> dict[str, float]:
    """The counters of a ``once`` hash (HGETALL), each present, and the cache's hit rate:
    ``hit / (hit + miss + coalesced)`` (0 before any look-up)."""
    figures: dict[str, float] = {name: 0 for name in ONCE_COUNTERS}
    for name, value in raw.items():
        key = name.decode() if isinstance(name, bytes) else str(name)
        if key in figures:
            figures[key] = int(value)
    looked_up = figures["hit"] + figures["miss"] + figures["coalesced"]
    figures["hit_rate"] = round(figures["hit"] / looked_up, 4) if looked_up else 0.0
    return figures


async def cached_result(client: RedisClient, keys: QueueKeys, request_id: str) -> bytes | None:
    """The cached result that answered ``request_id`` (its result key holds none: the
    enqueue script answered it from the cache), while the cache still holds it."""
    known = await client.get(keys.request_input(request_id))
    if not isinstance(known, bytes) or known[40:42] != b" =":
        return None
    raw: bytes | None = await client.get(keys.cache(known[42:].decode()))
    return raw
